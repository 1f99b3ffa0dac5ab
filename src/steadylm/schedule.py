"""The learning-rate schedule: linear warmup, then cosine decay to `min_lr`, per optimizer step.

A pure function of the step, so the LightningModule, `doctor`'s LR plot and the tests all read
the same curve. Warmup avoids the large early updates that Adam makes before its second-moment
estimate has settled; the cosine tail avoids an abrupt drop.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))
