"""Every window once per epoch across ranks, in static-shape batches (the last padded with -1, so no rank waits
alone in a collective), resumable mid-epoch. The order is a keyed Feistel bijection of (seed, epoch): O(1) memory,
and any batch's windows can be recomputed (`batch_windows`). Optimizer step k takes positions [k·N, (k+1)·N) of an
epoch padded (or cut, `drop_last`) to whole steps of N windows, each rank every W-th: with N fixed (`data.global_batch_
tokens`) step k's windows are the same on 1 rank or 64, and a resume on another number continues (data/position.py).
"""

from __future__ import annotations

import itertools
import logging
import operator

import numpy as np
from torch.utils.data import Sampler

PAD_INDEX = -1
_M64 = (1 << 64) - 1
log = logging.getLogger("steadylm")
_BLOCK = 1 << 13  # epoch positions `__iter__` computes at a time (a few global batches at least)


def _mix64(x: int) -> int:
    """splitmix64 finaliser: a well-spread 64-bit hash of an int (for round keys)."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


class FeistelPermutation:
    """A keyed bijection of [0, n) in O(1) state: six Feistel rounds permute [0, 4^k) >= n, and a position that
    lands outside [0, n) is encrypted again until it falls inside (cycle walking). For shuffling, not secrecy."""

    ROUNDS = 6

    def __init__(self, n: int, key: int):
        self.n = int(n)
        bits = max(2, (max(self.n, 1) - 1).bit_length())
        self.half = (bits + bits % 2) // 2
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
            while (outside := out >= np.uint64(self.n)).any():
                out[outside] = self._encrypt(out[outside])
        return out.astype(np.int64)


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
        step_batches: int = 1,
    ):
        self.n_windows, self.batch_size = int(n_windows), int(batch_size)
        self.rank, self.world_size = int(rank), int(world_size)
        self.seed, self.shuffle, self.drop_last = int(seed), bool(shuffle), bool(drop_last)
        self.global_batch = self.batch_size * self.world_size  # windows of one micro-batch, all ranks
        self.step_batches = int(step_batches)  # micro-batches of one optimizer step (the accumulation)
        self.step_windows = self.global_batch * self.step_batches
        self.epoch = 0
        self.batches_done = 0  # batches handed out in the current epoch
        self.start_batch = 0  # batches to skip on the next iteration (resume), then reset
        self.per_block = max(1, _BLOCK // self.global_batch)
        self._order: tuple[int, FeistelPermutation] | None = None  # (epoch, its order), keys hashed once
        # Lightning calls `set_epoch` on `loader.batch_sampler.sampler`, never on the batch sampler itself.
        self.sampler = self

    def __len__(self) -> int:
        """Micro-batches of an epoch: whole optimizer steps (the last padded, or dropped with `drop_last`)."""
        N = self.step_windows
        return (self.n_windows + (0 if self.drop_last else N - 1)) // N * self.step_batches

    def set_epoch(self, epoch: int) -> None:
        if int(epoch) != self.epoch:
            self.epoch, self.start_batch, self.batches_done = int(epoch), 0, 0

    def global_windows(self, positions) -> np.ndarray:
        """Window ids at this epoch's positions (`PAD_INDEX` past the last window); the same on every rank."""
        epoch, pos = self.epoch, np.asarray(positions, dtype=np.int64)
        real = pos < self.n_windows
        out = np.full(pos.shape, PAD_INDEX, dtype=np.int64)
        if self.shuffle and (self._order is None or self._order[0] != epoch):
            self._order = (epoch, FeistelPermutation(self.n_windows, _mix64(self.seed) ^ epoch))
        out[real] = self._order[1](pos[real]) if self.shuffle else pos[real]
        return out

    def _batches(self, first: int, count: int) -> list[list[int]]:
        """This rank's window ids of global batches `first` .. `first + count - 1` (-1 = padding)."""
        G = self.global_batch
        ids = self.global_windows(np.arange(first * G, (first + count) * G)).reshape(count, G)
        return ids[:, self.rank :: self.world_size].tolist()

    def batch_windows(self, batch_idx: int) -> list[int]:
        """What `__iter__` yields at batch `batch_idx`."""
        return self._batches(batch_idx, 1)[0]

    def __iter__(self):
        # A block of batches' order at a time, handed out by C iterators: a step calls no function here.
        start, self.start_batch = self.start_batch, 0
        self.batches_done = start
        return itertools.chain.from_iterable(map(self._block, range(start, len(self), self.per_block)))

    def _block(self, first: int):
        """An iterator over this rank's batches `first`, ... of the block; `batches_done` counts what it yielded."""
        self._before, self._size = first, min(self.per_block, len(self) - first)
        self._rows = iter(self._batches(first, self._size))
        return self._rows

    @property
    def batches_done(self) -> int:
        """Batches handed out in the current epoch."""
        return self._before + (self._size - operator.length_hint(self._rows) if self._rows is not None else 0)

    @batches_done.setter
    def batches_done(self, value: int) -> None:
        self._before, self._rows, self._size = int(value), None, 0

    def shape(self) -> dict:
        """What a batch count means: windows per micro-batch and micro-batches per step (saved beside it)."""
        return {"global_batch": self.global_batch, "step_batches": self.step_batches}

    def state_at(self, epoch: int, batches_done: int, step: int | None = None) -> dict:
        """The state of a position: `batches_done` batches of `epoch` (before optimizer `step`, when known)."""
        return {"epoch": int(epoch), "batches_done": int(batches_done), **self.shape()}

    def state_dict(self) -> dict:
        return self.state_at(self.epoch, self.batches_done)

    def resume_batch(self, state: dict) -> tuple[int, str | None]:
        from steadylm.data.position import resume_batch  # loaded only by a resume

        return resume_batch(state, self.global_batch, self.step_batches)

    def load_state_dict(self, state: dict) -> None:
        self.epoch = int(state["epoch"])
        self.batches_done = self.start_batch = self.resume_batch(state)[0]
        if (mixture := state.get("mixture")) and self.rank == 0:  # a run on data.sources resumed on one data.dir
            log.info(
                "resume: the checkpoint read data.sources (%s); this run's one source goes on at window position %d of "
                "epoch %d of its own order, as if it had been read from step 0",
                ", ".join(mixture["names"]),
                self.start_batch * self.global_batch,
                self.epoch,
            )
