"""Epoch-exact, rank-aware batch sampler with static batch shapes and mid-epoch resume.

Every window is visited exactly once per epoch across all ranks; the last global batch is
padded with -1 (see `TokenWindows`) rather than dropped or wrapped around, so every rank yields
the same number of equally shaped batches and no rank waits alone in a collective.
It must never depend on anything but (seed, epoch, rank, world_size) for its order.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Sampler

PAD_INDEX = -1


class _EpochHook:
    """Lightning calls `set_epoch` on `loader.sampler` and `loader.batch_sampler.sampler`, never on
    the batch sampler itself; exposing this as `.sampler` routes that call to us."""

    def __init__(self, owner: "EpochBatchSampler"):
        self.owner = owner

    def set_epoch(self, epoch: int) -> None:
        self.owner.set_epoch(epoch)


class EpochBatchSampler(Sampler[list[int]]):
    def __init__(
        self,
        n_windows: int,
        batch_size: int,
        *,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in range for world_size {world_size}")
        self.n_windows = int(n_windows)
        self.batch_size = int(batch_size)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.batches_done = 0  # batches handed out in the current epoch
        self.start_batch = 0  # batches to skip on the next iteration (resume), then reset
        self.sampler = _EpochHook(self)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def __len__(self) -> int:
        if self.drop_last:
            return self.n_windows // self.global_batch
        return math.ceil(self.n_windows / self.global_batch)

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.start_batch = 0
            self.batches_done = 0

    def permutation(self, epoch: int | None = None) -> torch.Tensor:
        """The global order for an epoch, cut or padded to len(self) * global_batch."""
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + int(epoch))
            perm = torch.randperm(self.n_windows, generator=g)
        else:
            perm = torch.arange(self.n_windows)
        total = len(self) * self.global_batch
        if total <= self.n_windows:
            return perm[:total]
        return torch.cat([perm, torch.full((total - self.n_windows,), PAD_INDEX, dtype=perm.dtype)])

    def __iter__(self):
        perm = self.permutation()
        G, W = self.global_batch, self.world_size
        start, self.start_batch = self.start_batch, 0
        self.batches_done = start
        for s in range(start, len(self)):
            chunk = perm[s * G : (s + 1) * G]
            self.batches_done = s + 1
            yield chunk[self.rank :: W].tolist()

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.batches_done}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.batches_done = self.start_batch = int(state["batches_done"])
