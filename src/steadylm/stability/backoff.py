"""`Backoff`: the one LR backoff of the stability suite, bounded and counted per cause. A check whose alarm persists
asks for one: the LR scale times `lr_backoff`, at most `max_backoffs` times, and (`rewind`) the weights back to a
snapshot from before the trouble, because the damage of a too-high LR is done before any alarm fires and a lower LR
cannot undo it (`rewarm_steps` ramps the LR up again). It only decides and counts; `Stability.back_off` acts."""

from __future__ import annotations

from steadylm.errors import ConfigError


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
