"""`LossScaleMonitor`: under fp16 (`trainer.precision=16-mixed`), make the loss scaler's skips visible.

The GradScaler skips every step whose unscaled gradients overflow and halves the scale; a run whose
scale keeps collapsing is a silent stall: the loss curve goes flat while the step counter advances.
This counts each scaler skip in `optim/skipped_steps` (so the LR schedule does not advance on it),
logs `optim/loss_scale`, and raises an `fp16_skip_streak` event when `streak` skips run back to back.
Does nothing without a scaler: bf16 and fp32 do not need one.
"""

from __future__ import annotations

import lightning as L

from steadylm.logging_steps import will_log, write_metrics
from steadylm.stability.events import emit
from steadylm.stability.probe import ProbeUser, loss_scaler


class LossScaleMonitor(ProbeUser, L.Callback):
    def __init__(self, streak: int = 5) -> None:
        self.streak = int(streak)
        self.consecutive = 0

    def observe(self, trainer, pl_module, optimizer, m) -> None:
        scaler = loss_scaler(trainer)
        if scaler is None:
            return
        if will_log(trainer):
            write_metrics(trainer, {"optim/loss_scale": scaler.get_scale()})
        if not m.grad_nonfinite:
            self.consecutive = 0
            return
        self.suite.probe.skip(trainer, pl_module, m, null_grads=False)  # the scaler itself skips the update
        self.consecutive += 1
        if self.consecutive == self.streak:
            emit(
                trainer,
                m.step,
                "fp16_skip_streak",
                "log",
                {
                    "consecutive": self.consecutive,
                    "loss_scale": scaler.get_scale(),
                    "skipped_steps": pl_module.skipped_steps,
                },
            )

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive = int(state["consecutive"])
