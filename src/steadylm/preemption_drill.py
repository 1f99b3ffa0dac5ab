"""A preemption drill: one rank sends a signal to its own process at a chosen step.

For rehearsing what a cluster does (does the job checkpoint, requeue and resume by itself?) and for the
tests that need a signal at a known step: `+callbacks.drill={_target_: steadylm.preemption_drill.SignalAtStep,
step: 50}`. It only sends the signal; everything after that is `steadylm.preemption`'s.
"""

from __future__ import annotations

import os
import signal as signals

import lightning as L


class SignalAtStep(L.Callback):
    """Send `signal` to this process (on global rank `rank` only) as optimizer step `step + 1` starts."""

    def __init__(self, step: int, signal: str = "SIGTERM", rank: int = 0):
        self.step, self.signum, self.rank = int(step), signals.Signals[signal], int(rank)
        self._sent = False

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._sent and trainer.global_step == self.step and trainer.global_rank == self.rank:
            self._sent = True
            os.kill(os.getpid(), self.signum)
