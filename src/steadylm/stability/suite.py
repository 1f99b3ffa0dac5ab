"""`StabilitySuite`: the one object the stability callbacks of a fit share, and the order they act in.

One optimizer step, read from `module.py` on:

0. `on_train_batch_start`: every N steps `recovery` starts copying the state to host memory (a snapshot);
1. forward, loss, backward (the LightningModule; every micro-batch's loss goes to `suite.probe`);
2. `on_before_optimizer_step`: the first stability callback asks `suite.probe.due()`, which takes THE one
   measurement of the step (loss + pre-clip grad norm, one all-reduce; deferred: read a step late, the
   non-finite skip happening on the device through fused AdamW's `found_inf`). Each callback then
   `observe`s it, in config order: `guard` (non-finite -> skip; a streak -> `recovery`), `spike` (a
   persisting loss spike -> `recovery`; a one-off -> logged), `stats`, `loss_scale`, `recovery` (confirms
   the snapshot taken at that step as known-good, or drops it);
3. clipping (the module, with the probe's norm), the update (AdamW), the LR schedule;
4. `on_train_batch_end`: logging (`stats` on logging steps).

Everything the parts share lives here: the probe, the steps judged bad (`suspect_steps`), and the
`Recovery` that rolls back, escalates and stops. Nothing is hung on the Trainer. `attach` hands one suite
to every stability callback of a Trainer; a callback dropped from the config (`~callbacks.spike`) simply
is not there, and the rest work without it (without `callbacks.recovery`, rollbacks read checkpoints on disk).
"""

from __future__ import annotations

from steadylm.stability.probe import Measurement, ProbeUser, StepProbe


class StabilitySuite:
    def __init__(self) -> None:
        self.probe = StepProbe()
        self.users: list[ProbeUser] = []  # the bound callbacks, in the Trainer's order
        self.recovery = None  # the `Recovery` callback when configured; else a disk-only default (set in attach)
        self.suspect_steps: set[int] = set()  # steps whose measurement a detector judged bad (non-finite, spike)

    def settle(self, trainer, pl_module, optimizer=None) -> None:
        """Act on the measurement still in flight now (deferred): before a checkpoint is written, and at the end.

        Every user observes it; `optimizer` None (training over) means no rollback.
        """
        m = self.probe.take_pending()
        if m is not None:
            self.observe_all(trainer, pl_module, optimizer, m)

    def observe_all(self, trainer, pl_module, optimizer, m: Measurement) -> None:
        for cb in self.users:
            cb.observe(trainer, pl_module, optimizer, m)

    def finish(self, trainer, pl_module) -> None:
        """Once, at the end of training (every user forwards the hook; the first call does it)."""
        if self.probe.finished:
            return
        self.settle(trainer, pl_module)
        self.probe.finished = True
        self.probe.finish(trainer)
        for cb in self.users:
            end = getattr(cb, "on_suite_end", None)
            if end is not None:
                end(trainer, pl_module)


def attach(callbacks) -> StabilitySuite:
    """Give one `StabilitySuite` to every stability callback in `callbacks` (and return it)."""
    from steadylm.stability.recovery import Recovery

    users = [cb for cb in callbacks if isinstance(cb, ProbeUser)]
    suite = StabilitySuite()
    suite.users = users
    for cb in users:
        cb.bind(suite)
    if suite.recovery is None:
        suite.recovery = Recovery(every_n_steps=0)  # no snapshots: roll back from checkpoints on disk
        suite.recovery.suite = suite
    return suite


def suite_of(trainer) -> StabilitySuite | None:
    """The suite a Trainer's stability callbacks share (for tests and tools), or None without any."""
    return next((cb.suite for cb in trainer.callbacks if isinstance(cb, ProbeUser) and cb.suite is not None), None)
