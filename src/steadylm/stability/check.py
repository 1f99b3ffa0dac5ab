"""`Check`: the one protocol of a stability check, and `StepView`, what a check may read of the step.

`measure(view) -> {key: (op, tensor)}` (optional) on the device after backward, `op` "mean" or "max" over ranks, or
"norm" (L2 norms of this rank's slices of sharded tensors: the root of the ranks' summed squares under FSDP, the
mean of the replicas' equal values otherwise): the values join the step's one collective. `verdict(m, view) -> Verdict | list[Verdict]` on the host, from
`m.values[name]` (reduced; one step late when the read is deferred): `log`, `backoff` (`context["backoff"]`: what
its `Backoff` granted, `context["policy"]`: that `Backoff`), `skip` (only with `acts_before_update`), `rollback` to
before `onset`, or `stop`; its `metrics` go to the loggers at step `onset`. `state_dict()` of plain types rides in
every checkpoint under its name. Optional hooks, called only where a check defines them: `arm(view)` before the
step's first forward, `after_update(view, reduced)` once the update is in the weights (`reduced[name][key]`: a
"max" value still on the device), `restored()` after a restore, `restart()` after any LR backoff;
`window_state()`/`load_window_state(state)`: what the check has seen of the weights, copied with every snapshot and
given back when a rollback restores it; before `next_step` the owner calls none of them. Its events are read back by
`explain(events, lr, cut) -> str | None` (a staticmethod; the run's `unstable` line: cause and fix, or None) and
`describe(events, log) -> list[dict]` (diagnose's findings: onset, cause, summary, fix, optional rank; `log` the
run's `RunLog`), both optional, read in `stability.instability` for every check, built-in or not. Add one in config: `callbacks.stability.checks.<name>: {_target_: my.module.MyCheck, ...}`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from steadylm.stability.verdict import OK, Verdict

OPS = ("mean", "max", "norm")  # how a measured value is reduced over ranks


@dataclass(frozen=True)
class StepView:
    """The step a check judges, read-only: the Trainer and module for what the fields below do not cover."""

    step: int  # the optimizer step under way
    world_size: int
    loss_scale: float | None  # the fp16 loss scale now (None: no scaler)
    model_cfg: Any  # the model's `GPTConfig` (None for a model without one)
    trainer: Any
    module: Any
    batches: list = field(default_factory=list)  # the step's micro-batches so far, (x, y) each, on the device
    token_losses: list = field(default_factory=list)  # each micro-batch's per-position CE (B, T), detached; kept
    # only while a judged check sets `wants_token_losses` (else empty: a step nobody asks pays nothing)


class Check:
    """Subclass it, or write any class with the same methods (see the module doc)."""

    name: str = ""  # its config key, set by the owner; its event kind
    # It may skip the step under way: every step is then read at once (a late skip finds the update applied).
    acts_before_update: bool = False
    next_step: int | float = 0  # asleep before this step (see the module doc)
    wants_token_losses: bool = False  # the loss keeps each position's CE for `view.token_losses`

    def applies(self, trainer) -> bool:
        """Judged in this fit at all (e.g. the loss-scale check only under fp16). Asked once, at the fit's start."""
        return True

    def verdict(self, m, view: StepView) -> Verdict | list[Verdict]:
        return OK

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None: ...
