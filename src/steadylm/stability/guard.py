"""`NonFiniteGuard`: a non-finite loss or gradient on any rank skips the step on all ranks; `max_consecutive` in a
row roll back to before the streak, or stop. A skip drops the grads (zeroed ones would still decay and move AdamW).
Under fp16 a non-finite gradient with a finite loss is the loss scaler's business (`LossScaleMonitor`)."""

from __future__ import annotations

from steadylm.errors import ConfigError
from steadylm.stability.check import Check, StepView
from steadylm.stability.events import actions_done
from steadylm.stability.verdict import OK, Verdict

ACTIONS = ("rollback", "stop")
KINDS = ("nonfinite_loss", "nonfinite_grad")


def describe(events: list[dict], log) -> list[dict]:
    """diagnose's finding: the first non-finite step and the module the forensics named (none: a one-off)."""
    hits = [e for e in events if e["kind"] in KINDS]
    if not hits:
        return []
    first, acted = hits[0], actions_done(hits)
    module, evidence = first["detail"].get("module"), first["detail"].get("evidence") or ""
    step, what = first["step"], "loss" if first["kind"] == "nonfinite_loss" else "gradient"
    if module is None and evidence.startswith("transient"):
        cause, summary = "transient non-finite", f"non-finite {what} at step {step}, {evidence}: no module is named"
        fix = "a one-off (the step was skipped); if it recurs, run from the last checkpoint with debug=anomaly"
    elif first["kind"] == "nonfinite_loss":
        module = module or "an unnamed module"
        cause, summary = "non-finite forward", f"first non-finite output in {module} at step {step}"
        fix = (
            f"a weight or activation in {module} became NaN/inf: read stability/forensics/, "
            "re-run from the last good checkpoint with debug=anomaly"
        )
    else:
        module = module or "an unnamed module"
        cause, summary = (
            "non-finite gradient",
            f"first non-finite gradient in {module} at step {step} with a finite loss",
        )
        fix = (
            f"the backward pass through {module} overflowed: check its inputs and scale, prefer bf16-mixed "
            "over fp16, run with debug=anomaly to name the op"
        )
    return [{"onset": step, "cause": cause, "summary": f"{summary} ({acted})", "fix": fix}]


class NonFiniteGuard(Check):
    name = "guard"

    def __init__(self, max_consecutive: int = 3, action: str = "rollback") -> None:
        if action not in ACTIONS:
            raise ConfigError(f"callbacks.stability.guard.action={action!r} is not one of {', '.join(ACTIONS)}")
        if max_consecutive < 1:
            raise ConfigError(f"callbacks.stability.guard.max_consecutive={max_consecutive} must be >= 1")
        self.max_consecutive, self.action = int(max_consecutive), action
        self.consecutive, self.streak_start = 0, -1

    def verdict(self, m, view: StepView) -> Verdict:
        if not (m.loss_nonfinite or m.grad_nonfinite) or (view.loss_scale is not None and not m.loss_nonfinite):
            self.consecutive = 0
            return OK
        if self.consecutive == 0:
            self.streak_start = m.step
        self.consecutive += 1
        kind = "nonfinite_loss" if m.loss_nonfinite else "nonfinite_grad"
        detail = {"value": m.loss if m.loss_nonfinite else m.grad_norm, "consecutive": self.consecutive}
        context = {"first": self.consecutive == 1}
        if self.consecutive < self.max_consecutive:
            return Verdict("skip", kind, detail, suspect=True, context=context)
        reason = f"{self.consecutive} non-finite steps in a row from step {self.streak_start}"
        if self.action == "stop":
            reason += "; callbacks.stability.guard.action=stop"
        return Verdict(self.action, kind, detail, onset=self.streak_start, reason=reason, suspect=True, context=context)

    def restored(self) -> None:
        self.consecutive = 0

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "streak_start": self.streak_start}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive, self.streak_start = int(state["consecutive"]), int(state["streak_start"])
