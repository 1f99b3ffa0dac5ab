"""Which training steps the Trainer writes logs on, and a cheap way to write many scalars on them.

`self.log` costs milliseconds per metric (validation, tensor wrapping, reduction bookkeeping), and per-step
scalars reach the logger only every `trainer.log_every_n_steps`; so every scalar only a logger reads (lr, grad
norm, skips, throughput, 60+ per-block stability stats) goes straight to the loggers, on logging steps, at the
step number Lightning uses. Only `train/loss` and `val/loss` use `self.log`: the progress bar,
`callback_metrics` and a sweep's objective read them. Lightning's internals are reached through `compat`.
"""

from __future__ import annotations

import lightning as L

from steadylm import compat


def is_logging_step(step: int, every: int) -> bool:
    """Optimizer step `step` (0-based) is one Lightning writes logs on: known before it runs, so measurements
    can be switched on for it."""
    return (step + 1) % max(1, every) == 0


def write_metrics(trainer: L.Trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """Plain floats to every logger (rank 0 only) at the step Lightning logs this batch at, or at optimizer
    step `step` (a measurement that arrived after its step)."""
    step = compat.logged_step(trainer) if step is None else step
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)
