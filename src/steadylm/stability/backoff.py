"""`Backoff`: the one LR backoff of the stability suite, bounded and counted per cause.

A check whose alarm persists (QK-clip clipping `backoff_after` measurements in a row, a precursor signal past
its alarm level `persist` measurements in a row) asks for a backoff: the LR scale is multiplied by
`lr_backoff`, at most `max_backoffs` times for that cause in the run, and (`rewind`) the weights go back to a
snapshot from before the trouble began, because the damage of a too-high LR (a residual stream grown 100-fold)
is done before any alarm fires and a lower LR cannot undo it. `rewarm_steps` ramps the LR up again from the
restored weights, as at the start. This class only decides and counts; the step owner (`Stability.back_off`)
applies the factor, rewinds and writes the `lr_backoff` event, the same way for every cause.
"""

from __future__ import annotations

from steadylm.errors import ConfigError


class Backoff:
    def __init__(
        self, where: str, lr_backoff: float | None, max_backoffs: int, rewind: bool, rewarm_steps: int
    ) -> None:
        if lr_backoff is not None and not 0 < lr_backoff <= 1:
            raise ConfigError(f"{where}.lr_backoff={lr_backoff} must be in (0, 1], or null to never lower the LR")
        if not isinstance(rewind, bool):
            raise ConfigError(f"{where}.rewind={rewind!r} must be true or false")
        if not isinstance(rewarm_steps, int) or rewarm_steps < 0:
            raise ConfigError(f"{where}.rewarm_steps={rewarm_steps!r} must be an integer >= 0 (0: no re-warmup)")
        self.lr_backoff, self.max_backoffs = lr_backoff, int(max_backoffs)
        self.rewind, self.rewarm_steps = rewind, rewarm_steps
        self.backoffs = 0
        self.lr_scale = 1.0  # the product of the LR factors asked for so far

    @property
    def enabled(self) -> bool:
        return self.lr_backoff is not None and self.lr_backoff < 1

    def ask(self, onset: int) -> dict | None:
        """One backoff for trouble that began at step `onset`: the evidence the owner acts on (the factor, the new
        scale, the count, `rewind_before`: restore a snapshot taken before that step), or None when the budget is
        spent or backoff is off."""
        if not self.enabled or self.backoffs >= self.max_backoffs:
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
