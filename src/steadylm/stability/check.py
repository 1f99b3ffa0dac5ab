"""`Check`: the one protocol of a stability check, and `StepView`, what a check may read of the step.

A check is a class with three parts, and nothing else to edit to add one:

- **what it measures**: `measure(view) -> {key: (op, tensor)}`, on the device, after backward and before the
  update. `op` is `"mean"` or `"max"` over ranks. Every check's values join the step's one collective (one
  all-reduce per op, together with the loss and the grad norm) and reach the host once; a check that measures
  nothing leaves `measure` out and costs nothing.
- **its verdict**: `verdict(m, view) -> Verdict | list[Verdict]`, on the host, from the step's `Measurement`
  `m` (loss, grad norm, and `m.values[name]`: every check's keys, reduced; one step late when the read is
  deferred). A verdict whose `kind` is None but whose action is not `ok` is written to the events log under the
  check's name; its `metrics` go to the loggers at step `onset`.
- **its state**: `state_dict()` / `load_state_dict()` of plain types, kept in every checkpoint under its name.

A verdict may `log` (an event), `backoff` (lower the LR and rewind: `context["backoff"]` is the evidence its
`Backoff` granted, `context["policy"]` that `Backoff`), `skip` the step (only with `acts_before_update = True`),
`rollback` to a state from before `onset`, or `stop` the run. Write its events as `Verdict(action, self.name,
detail, onset=step)`.

Optional hooks serve checks that act on the model itself (QK-clip, the stats): `arm(view)` at the step's
first micro-batch, before its forward (switch a measurement on); `after_update(view, reduced)` once the update
is in the weights, where `reduced[name][key]` is a "max" value of the step's collective still on the device
(act there without a host read); `restored()` after the suite restored weights (forget what was measured on
the abandoned ones); `restart()` after any LR backoff (a streak starts again). A check that judges some steps
only sets `next_step`, the first step it wants again: before it the owner calls none of its hooks, and asks its
verdict only on a measurement that carries its own values (the stats between stats steps, step 0's loss after
step 0), so a quiet step costs it nothing.

It is added by naming it in config, `callbacks.stability.checks.<name>: {_target_: my.module.MyCheck, ...}`;
its events are `<name>` events. The step owner (`Stability.judge`) asks every check in order and applies the
verdicts (skip, backoff, rollback, stop, log), so escalation and the rollback budget stay in one place. Every
built-in check (guard, spike, loss scale, init loss, QK-clip, stats, signals) follows the same protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from steadylm.stability.verdict import OK, Verdict

OPS = ("mean", "max")


@dataclass(frozen=True)
class StepView:
    """The step a check judges, read-only: the Trainer and module for what the fields below do not cover."""

    step: int  # the optimizer step under way
    world_size: int
    loss_scale: float | None  # the fp16 loss scale now (None: no scaler)
    model_cfg: Any  # the model's `GPTConfig` (None for a model without one)
    trainer: Any
    module: Any


class Check:
    """Subclass it, or write any class with the same methods (see the module doc)."""

    name: str = ""  # its config key, set by the owner; its event kind
    # Its verdict may skip the step under way: then every step is read at once (one host sync a step) instead of
    # a step late, because a late skip would find the update already in the weights.
    acts_before_update: bool = False
    next_step: int | float = 0  # asleep before this step (see the module doc)

    def applies(self, trainer) -> bool:
        """Judged in this fit at all (e.g. the loss-scale check only under fp16). Asked once, at the fit's start."""
        return True

    def arm(self, view: StepView) -> None:
        pass

    def measure(self, view: StepView) -> dict[str, tuple[str, torch.Tensor]]:
        return {}

    def after_update(self, view: StepView, reduced) -> None:
        pass

    def verdict(self, m, view: StepView) -> Verdict | list[Verdict]:
        return OK

    def restored(self) -> None:
        pass

    def restart(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def overrides(check: Any, hook: str) -> bool:
    """The check has its own `hook` (a plain class with the method, or a `Check` subclass overriding it): the
    owner calls only those, so a hook a check leaves out costs nothing."""
    fn = getattr(type(check), hook, None)
    return fn is not None and fn is not getattr(Check, hook)
