"""The learning-rate schedule: linear warmup, then `cosine`, `linear` or `wsd` (flat, then a `1 - sqrt` decay over
the last `decay_fraction`: Hägele et al. 2024) down to `min_lr` at `total_steps`, per applied step. No scheduler
object or state: before each update the module sets the LR from `Schedule.lr_of`, as nanochat and OLMo-core do."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from steadylm.errors import ConfigError

SHAPES = ("cosine", "wsd", "linear")  # each shape's share of (lr - min_lr) is in `Schedule.lr_of`


@dataclass(frozen=True)
class Schedule:
    lr: float
    min_lr: float
    warmup_steps: int
    total_steps: int
    shape: str = "cosine"  # optim.schedule
    decay_fraction: float = 0.2  # optim.decay_fraction: wsd's decay, as a share of total_steps

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ConfigError(f"optim.schedule={self.shape!r} is not allowed; use one of: {', '.join(SHAPES)}")
        if self.shape == "wsd" and not 0 < self.decay_fraction <= 1:
            raise ConfigError(
                f"optim.decay_fraction={self.decay_fraction!r} is not allowed; it must be a share of the run in (0, 1]"
                " (0.2: the last 20 % of the steps decay)"
            )
        if self.decay_start < self.warmup_steps:  # wsd's decay only: otherwise it starts at the end of warmup
            raise ConfigError(
                f"optim.decay_fraction={self.decay_fraction} starts wsd's decay at step {self.decay_start} of "
                f"{self.total_steps}, inside the {self.warmup_steps}-step warmup; lower optim.decay_fraction or "
                "optim.warmup_steps"
            )

    @classmethod
    def from_optim(cls, optim: Mapping) -> Schedule:
        return cls(
            lr=float(optim["lr"]),
            min_lr=float(optim["min_lr"]),
            warmup_steps=int(optim["warmup_steps"]),
            total_steps=int(optim["total_steps"]),
            shape=str(optim.get("schedule", "cosine")),
            decay_fraction=float(optim.get("decay_fraction", 0.2)),
        )

    @functools.cached_property
    def decay_start(self) -> int:
        """The first step whose LR depends on the run's length: wsd's decay, else the end of warmup."""
        if self.shape == "wsd":
            return self.total_steps - round(self.decay_fraction * self.total_steps)
        return self.warmup_steps

    def __call__(self, step: int) -> float:
        return self.lr_of(step)

    def lr_of(self, step: int, scale: float = 1.0, rewarm: tuple[int, int] = (0, 0)) -> float:
        """The schedule at applied step `step` x the LR scale x a re-warmup after a rewind, `rewarm = (start,
        length)`: a warmup begun again at applied step `start` over `length` steps."""
        start, length = rewarm
        warm = (step - start + 1) / length if length and 0 <= step - start < length else 1.0
        if step < self.warmup_steps:
            lr = self.lr * (step + 1) / self.warmup_steps
        elif step >= self.total_steps:
            lr = self.min_lr
        elif step < (begin := self.decay_start):  # wsd's stable phase
            lr = self.lr
        else:
            p = (step - begin) / max(1, self.total_steps - begin)  # through the decay, in [0, 1]
            if self.shape == "cosine":
                share = 0.5 * (1.0 + math.cos(math.pi * p))
            else:
                share = 1.0 - (math.sqrt(p) if self.shape == "wsd" else p)
            lr = self.min_lr + (self.lr - self.min_lr) * share  # each shape's share of (lr - min_lr)
        return lr * warm * scale

    def describe(self) -> str:
        """One line: `wsd: warmup 100, flat 0.003 to step 800, 1-sqrt decay to 0.0003 at step 1000`."""
        warm = f"warmup {self.warmup_steps}, "
        if self.shape == "wsd":
            return (
                f"wsd: {warm}flat {self.lr:.3g} to step {self.decay_start}, 1-sqrt decay to {self.min_lr:.3g} "
                f"at step {self.total_steps}"
            )
        return f"{self.shape}: {warm}{self.lr:.3g} decaying to {self.min_lr:.3g} at step {self.total_steps}"


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Every group's LR for the next update: `lr` times the group's own multiplier (`lr_mult`, default 1)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)
