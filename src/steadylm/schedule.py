"""The learning-rate schedule: linear warmup, then cosine decay to `min_lr`, per applied optimizer step.

A pure function of the step, so the LightningModule, `doctor`'s LR plot and the tests all read
the same curve; there is no scheduler object. Before each update the module sets every group's LR
from the count of applied steps (a skipped step does not advance it) times its LR scale (lowered by a
repeated rollback), as nanochat and OLMo-core do. Warmup avoids the large early updates that Adam makes before its second-moment
estimate has settled; the cosine tail avoids an abrupt drop.
"""

from __future__ import annotations

import math

import torch


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def rewarm_factor(step: int, rewarm: tuple[int, int]) -> float:
    """The LR's share at applied step `step` of a warmup begun again at applied step `start` over `length` steps
    (after a QK-clip rewind: the restored weights take the restored LR as a fresh start would, not at once)."""
    start, length = rewarm
    return (step - start + 1) / length if length and 0 <= step - start < length else 1.0


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's LR for the next update: `lr` times the group's own multiplier (`lr_mult`, default 1)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
