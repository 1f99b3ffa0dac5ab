"""Which training steps the Trainer writes logs on, and a cheap way to write many scalars on them.

Per-step scalars reach the logger only every `trainer.log_every_n_steps`; calling `self.log` on other
steps is Python time on the hot path for values nobody sees. And `self.log` costs milliseconds per metric
(validation, tensor wrapping, reduction bookkeeping), so every scalar that only a logger reads (lr, grad
norm, skips, throughput, the per-block stability stats: 60+ for a 12-layer model) goes straight to the
loggers at the step number Lightning itself uses. Only `train/loss` and `val/loss` use `self.log`: the
progress bar, `callback_metrics` and a sweep's objective read them.
Both lean on Lightning internals, reached through `steadylm.compat`.
"""

from __future__ import annotations

import lightning as L

from steadylm import compat


def is_logging_step(step: int, every: int) -> bool:
    """Optimizer step `step` (0-based) is one Lightning writes logs on, when every `every` steps: known before
    the step runs, so measurements can be switched on for it."""
    return (step + 1) % max(1, every) == 0


def write_metrics(trainer: L.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """Write plain floats to every logger (rank 0 only) at the step Lightning writes this batch's logs, or at
    optimizer step `step` (a measurement that arrived later than its step)."""
    step = compat.logged_step(trainer) if step is None else step
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
