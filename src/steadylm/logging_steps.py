"""Which steps the Trainer logs on, and a cheap way to write scalars on them: `self.log` costs milliseconds per
metric, so what only a logger reads goes straight to the loggers (only `train/loss` and `val/loss` use `self.log`).
"""

from __future__ import annotations

from steadylm import compat


def is_logging_step(step: int, every: int) -> bool:
    """Optimizer step `step` (0-based) is logged: known before it runs, so measurements can be switched on."""
    return (step + 1) % max(1, every) == 0


def write_metrics(trainer, metrics: dict[str, float], step: int | None = None) -> None:
    """Plain floats to every logger (rank 0 only) at this batch's logging step, or at optimizer step `step`."""
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=compat.logged_step(trainer) if step is None else step)
