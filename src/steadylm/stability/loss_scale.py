"""`LossScaleMonitor`: under fp16 (`trainer.precision=16-mixed`), make the loss scaler's skips visible.

A scale that keeps collapsing is a silent stall (a flat loss while the steps advance). Each scaler skip is a
`skip` verdict (the LR does not advance), `streak` skips back to back an `fp16_skip_streak` event.
"""

from __future__ import annotations

from steadylm.stability.check import Check, StepView
from steadylm.stability.measure import Measurement, loss_scaler
from steadylm.stability.verdict import OK, Verdict


class LossScaleMonitor(Check):
    name = "loss_scale"

    def __init__(self, streak: int = 5) -> None:
        self.streak = int(streak)
        self.consecutive = 0

    def applies(self, trainer) -> bool:
        return loss_scaler(trainer) is not None

    def verdict(self, m: Measurement, view: StepView) -> Verdict:
        scale = view.loss_scale
        if scale is None:
            return OK
        if not m.grad_nonfinite:
            self.consecutive = 0
            return OK
        self.consecutive += 1
        if self.consecutive != self.streak:
            return Verdict("skip", suspect=True)  # the scaler itself skips the update; this counts it
        detail = {"consecutive": self.consecutive, "loss_scale": scale}
        return Verdict("skip", "fp16_skip_streak", detail, suspect=True)

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive = int(state["consecutive"])
