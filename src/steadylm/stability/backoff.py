"""`Backoff`: the one LR backoff of the stability suite, bounded and counted per cause. A check whose alarm persists
asks for one: the LR scale times `lr_backoff`, at most `max_backoffs` times, and (`rewind`) the weights back to a
snapshot from before the trouble, because the damage of a too-high LR is done before any alarm fires and a lower LR
cannot undo it (`rewarm_steps` ramps the LR up again). `Backoff` decides and counts; `act` carries a grant out."""

from __future__ import annotations

from steadylm.errors import ConfigError
from steadylm.stability.events import emit


class Backoff:
    def __init__(self, where: str, lr_backoff, max_backoffs: int, rewind: bool, rewarm_steps: int) -> None:
        if lr_backoff is not None and not 0 < lr_backoff <= 1:
            raise ConfigError(f"{where}.lr_backoff={lr_backoff} must be in (0, 1], or null to never lower the LR")
        if not isinstance(rewind, bool):
            raise ConfigError(f"{where}.rewind={rewind!r} must be true or false")
        if not isinstance(rewarm_steps, int) or rewarm_steps < 0:
            raise ConfigError(f"{where}.rewarm_steps={rewarm_steps!r} must be an integer >= 0 (0: no re-warmup)")
        self.lr_backoff, self.max_backoffs = lr_backoff, int(max_backoffs)
        self.rewind, self.rewarm_steps = rewind, rewarm_steps
        self.backoffs, self.lr_scale = 0, 1.0  # lr_scale: the product of the factors granted so far

    def ask(self, onset: int) -> dict | None:
        """One backoff for trouble that began at step `onset`: the evidence the owner acts on (`rewind_before`:
        restore a snapshot taken before that step), or None when the budget is spent or backoff is off."""
        if self.lr_backoff is None or self.lr_backoff >= 1 or self.backoffs >= self.max_backoffs:
            return None
        self.backoffs += 1
        self.lr_scale *= self.lr_backoff
        out = {"lr_backoff": self.lr_backoff, "lr_scale": self.lr_scale, "backoffs": self.backoffs, "onset": onset}
        if self.rewind:
            out["rewind_before"] = onset - 1
        return out

    def state_dict(self) -> dict:
        return {"backoffs": self.backoffs, "lr_scale": self.lr_scale}

    def load_state_dict(self, state: dict) -> None:
        self.backoffs, self.lr_scale = int(state["backoffs"]), float(state["lr_scale"])


def act(owner, trainer, pl_module, v, detail: dict) -> bool:
    """Carry out `Stability`'s (`owner`) LR verdict `v`: a forecast's temporary hold (or its end), or a backoff a
    check's `Backoff` granted (the LR scaled, maybe a rewind and a re-warmup). True when it rewound."""
    c = v.context
    if c.get("temporary"):  # no rewind, no restart, not counted
        pl_module.scale_lr(c["factor"])
        if "pin_before" in c:
            owner.recovery.pin(c["pin_before"])
        if c.get("unpin"):
            owner.recovery.unpin()
        emit(trainer, v.onset, v.kind, v.action, {**detail, "lr_scale": pl_module.lr_scale})
        return False
    emit(trainer, v.onset, v.kind, c.get("event_action", "log"), detail)
    granted, rewarm = dict(c["backoff"]), c["policy"].rewarm_steps
    pl_module.scale_lr(granted["lr_backoff"])
    keys = ("rewind_before", "rewind_latest", "rewind_first", "growth_from")
    target = {k: granted.pop(k) for k in keys if k in granted}
    event = {**granted, "cause": c["cause"], "reason": c["why"]}
    restored = None
    if "rewind_before" in target:  # back to the snapshot QK-clip's `rewind_target` names, else before the onset
        before = target["rewind_before"]
        latest, first = target.get("rewind_latest", before), target.get("rewind_first", True)
        restored = owner.recovery.rewind(trainer, pl_module, before, latest, to_first=first)
    if restored is not None:
        owner.continue_from(trainer, pl_module, restored, rewarm)  # the LR ramps up again, as at the start
        event["rewound_to"] = restored["to_step"]
        if "growth_from" in target:
            event["growth_from"] = target["growth_from"]  # the last step the logits were below the floor
        if rewarm:
            event["rewarm_steps"] = rewarm
    emit(trainer, v.onset, "lr_backoff", "backoff", event)
    if restored is not None:
        emit(trainer, v.onset, "rollback", "rollback", {**restored, "cause": c["cause"], "onset": event["onset"]})
    for check in (ch for ch in owner.checks if hasattr(ch, "restart")):  # one backoff answers every streak
        check.restart()
    return restored is not None
