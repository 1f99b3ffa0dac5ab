"""Epoch-exact, rank-aware batch sampler with static batch shapes and mid-epoch resume.

Every window is visited exactly once per epoch across all ranks; the last global batch is
padded with -1 (see `TokenWindows`) rather than dropped or wrapped around, so every rank yields
the same number of equally shaped batches and no rank waits alone in a collective.
It must never depend on anything but (seed, epoch, rank, world_size) for its order.

The epoch's order is a keyed bijection of [0, n_windows) computed per position (`FeistelPermutation`),
never a materialised permutation: per-rank memory is O(1) in the corpus size, so a corpus of billions of
tokens costs no more to shuffle than a small one, and any batch's windows can be recomputed on demand
(`batch_windows`) for resume and forensics.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import Sampler

PAD_INDEX = -1
_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a well-spread 64-bit hash of an int (for round keys)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class FeistelPermutation:
    """A pseudo-random bijection of [0, n) keyed by `key`, evaluated on any positions in O(len) time and O(1) state.

    A balanced Feistel network permutes [0, 4^k) (the smallest even-bit domain >= n, so < 4n); positions that
    land outside [0, n) are encrypted again until they fall inside ("cycle walking"), which keeps it a
    bijection of [0, n). Six rounds of a multiply-xorshift round function give an order with no visible
    structure for shuffling purposes (it is not a cipher).
    """

    ROUNDS = 6

    def __init__(self, n: int, key: int):
        self.n = int(n)
        bits = max(2, (max(self.n, 1) - 1).bit_length())
        bits += bits % 2
        self.half = bits // 2
        self.mask = np.uint64((1 << self.half) - 1)
        self.keys = [np.uint64(_mix64((int(key) & _M64) ^ _mix64(r))) for r in range(self.ROUNDS)]

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for k in self.keys:  # round function: multiply-xorshift of (right ^ k)
            f = (right ^ k) * np.uint64(0x9E3779B97F4A7C15)
            f ^= f >> np.uint64(29)
            f *= np.uint64(0xBF58476D1CE4E5B9)
            f ^= f >> np.uint64(32)
            left, right = right, left ^ (f & self.mask)
        return (left << h) | right

    def __call__(self, positions) -> np.ndarray:
        x = np.asarray(positions, dtype=np.uint64)
        if x.size and int(x.max()) >= self.n:
            raise IndexError(f"position {int(x.max())} outside [0, {self.n})")
        with np.errstate(over="ignore"):
            out = self._encrypt(x)
            out_of_range = out >= np.uint64(self.n)
            while out_of_range.any():
                out[out_of_range] = self._encrypt(out[out_of_range])
                out_of_range = out >= np.uint64(self.n)
        return out.astype(np.int64)


class _EpochHook:
    """Lightning calls `set_epoch` on `loader.sampler` and `loader.batch_sampler.sampler`, never on
    the batch sampler itself; exposing this as `.sampler` routes that call to us."""

    def __init__(self, owner: EpochBatchSampler):
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
        self.global_batch = self.batch_size * self.world_size
        self._orders: dict[int, FeistelPermutation] = {}  # the epoch's order, built once (its keys are hashed)

    def __len__(self) -> int:
        if self.drop_last:
            return self.n_windows // self.global_batch
        return math.ceil(self.n_windows / self.global_batch)

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.start_batch = 0
            self.batches_done = 0

    def _order(self, epoch: int) -> FeistelPermutation | None:
        if not self.shuffle:
            return None
        if epoch not in self._orders:
            self._orders = {epoch: FeistelPermutation(self.n_windows, _mix64(self.seed) ^ int(epoch))}
        return self._orders[epoch]

    def global_windows(self, positions, epoch: int | None = None) -> np.ndarray:
        """Window ids at epoch positions (`PAD_INDEX` past the last window); the same on every rank."""
        epoch = self.epoch if epoch is None else int(epoch)
        pos = np.asarray(positions, dtype=np.int64)
        real = pos < self.n_windows
        order = self._orders.get(epoch) or self._order(epoch)
        ids = pos[real] if order is None else order(pos[real])
        out = np.full(pos.shape, PAD_INDEX, dtype=np.int64)
        out[real] = ids
        return out

    def batch_windows(self, batch_idx: int, epoch: int | None = None) -> list[int]:
        """This rank's window ids of global batch `batch_idx` (-1 = padding): what `__iter__` yields there."""
        G = self.global_batch
        chunk = self.global_windows(np.arange(batch_idx * G, (batch_idx + 1) * G), epoch)
        return chunk[self.rank :: self.world_size].tolist()

    def permutation(self, epoch: int | None = None) -> torch.Tensor:
        """The whole epoch's global order, cut or padded to len(self) * global_batch.

        Materialises O(n_windows) ids: for tests and small corpora; training uses `batch_windows`.
        """
        return torch.from_numpy(self.global_windows(np.arange(len(self) * self.global_batch), epoch))

    def __iter__(self):
        start, self.start_batch = self.start_batch, 0
        self.batches_done = start
        for s in range(start, len(self)):
            batch = self.batch_windows(s)
            self.batches_done = s + 1
            yield batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batches_done": self.batches_done}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.batches_done = self.start_batch = int(state["batches_done"])
