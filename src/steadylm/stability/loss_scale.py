"""`LossScaleMonitor`: under fp16 a scale that keeps collapsing is a silent stall (a flat loss while the steps
advance): each scaler skip is a `skip` verdict (the LR does not advance), `streak` in a row an `fp16_skip_streak`."""

from __future__ import annotations

from steadylm.stability.check import Check, StepView
from steadylm.stability.measure import loss_scaler
from steadylm.stability.verdict import OK, Verdict


def describe(events: list[dict], log) -> list[dict]:
    """diagnose's finding: the first streak of skipped fp16 steps, from where it began."""
    hits = [e for e in events if e["kind"] == "fp16_skip_streak"]
    if not hits:
        return []
    step, d = hits[0]["step"], hits[0]["detail"]
    n = int(d.get("consecutive", 1))
    summary = (
        f"{n} consecutive fp16 steps skipped (gradients overflowed) ending at step {step}, "
        f"loss scale {d.get('loss_scale', float('nan')):g}"
    )
    fix = "use trainer.precision=bf16-mixed; with fp16, start the scaler lower and keep clipping on"
    return [{"onset": step - n + 1, "cause": "fp16 loss-scale overflow", "summary": summary, "fix": fix}]


class LossScaleMonitor(Check):
    name = "loss_scale"

    def __init__(self, streak: int = 5) -> None:
        self.streak, self.consecutive = int(streak), 0

    def applies(self, trainer) -> bool:
        return loss_scaler(trainer) is not None

    def verdict(self, m, view: StepView) -> Verdict:
        if view.loss_scale is None:
            return OK
        if not m.grad_nonfinite:
            self.consecutive = 0
            return OK
        self.consecutive += 1
        if self.consecutive != self.streak:
            return Verdict("skip", suspect=True)  # the scaler itself skips the update; this counts it
        return Verdict(
            "skip", "fp16_skip_streak", {"consecutive": self.consecutive, "loss_scale": view.loss_scale}, suspect=True
        )

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive = int(state["consecutive"])
