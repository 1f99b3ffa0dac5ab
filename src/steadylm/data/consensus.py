"""A bad window found on one rank stops every rank, with the same one-line error.

Under DDP a rank that raised while reading its batch would leave the others blocked in the gradient all-reduce
until the transport noticed the dead peer, a traceback on every rank. Here the failing rank records the error and
trains that step on a stand-in batch (its previous one, else padding), and each fetch posts a one-int "my read
failed" flag to an asynchronous all-reduce on a CPU (gloo) group, waited for at the next fetch (long complete by
then). If any rank failed, rank 0 raises the first message as `ShardReadError` and the others exit with status 2.
Loaded only under several ranks; it never changes which batches a healthy run sees.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from steadylm.data.dataset import ShardReadError
from steadylm.data.sampler import PAD_INDEX

_GROUP: list = []  # (the default group, a gloo group beside it): created collectively on first use


def _cpu_group():
    """One gloo group per default process group: a sweep's next job on several devices starts a new default group
    (distributed.job_processes), and a group of the last one would wait for processes that are gone."""
    if not _GROUP or _GROUP[0][0] is not dist.group.WORLD:
        _GROUP[:] = [(dist.group.WORLD, dist.new_group(backend="gloo"))]
    return _GROUP[0][1]


class _Consensus:
    def __init__(self, it, loader: ConsensusLoader):
        self.it, self.loader = it, loader
        self.pending = None
        self.message: str | None = None
        self.last = None

    def __iter__(self):
        return self

    def _settle(self) -> None:
        if self.pending is None:
            return
        work, flag = self.pending
        self.pending = None
        work.wait()
        if int(flag[0]) > 0:  # a host tensor: reading it never waits for a device
            messages = [None] * dist.get_world_size(self.loader.group)
            dist.all_gather_object(messages, self.message, group=self.loader.group)
            if dist.get_rank() != 0:
                # Rank 0 reports it; the others leave quietly with the same exit status, so the user reads
                # one line rather than one per rank interleaved on a shared terminal.
                raise SystemExit(2)
            raise ShardReadError(next(m for m in messages if m))

    def __next__(self):
        self._settle()
        try:
            batch = next(self.it)
            failed = 0
        except StopIteration:
            raise
        except ShardReadError as err:
            self.message, failed = str(err), 1
            batch = self.last if self.last is not None else self.loader.padding_batch()
        self.last = batch
        flag = torch.tensor([failed], dtype=torch.int32)
        self.pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.loader.group, async_op=True), flag)
        return batch


class ConsensusLoader(DataLoader):
    """A DataLoader whose iterator stops all ranks together on a `ShardReadError` (see the module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.group = _cpu_group()

    def padding_batch(self) -> Any:
        n = getattr(self.batch_sampler, "batch_size", None) or 1
        return self.collate_fn([self.dataset[PAD_INDEX] for _ in range(n)])

    def __iter__(self):
        return _EndSettles(_Consensus(super().__iter__(), self))


class _EndSettles:
    """At the end of the epoch, the last batch's flag is settled before StopIteration (all ranks end together)."""

    def __init__(self, inner: _Consensus):
        self.inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.inner)
        except StopIteration:
            self.inner._settle()
            raise

    def __len__(self):
        return len(self.inner.loader)
