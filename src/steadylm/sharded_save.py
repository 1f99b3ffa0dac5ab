"""How FSDP2 writes a distributed checkpoint (a folder, each rank its own shards), so that a kill mid-save never
leaves a folder that looks complete and is not, and training waits only while the state is copied, not written.

Every rank writes into a hidden `.<name>.tmp` beside the target; once every rank's shards and DCP's `.metadata` are
in, rank 0 adds `meta.pt` (the non-tensor part) and swaps the folder into place with two renames. Saving in place,
as Lightning does, would mix a new save's shards with the old `.metadata` if killed halfway.

With `async_save`, torch's `async_save` first copies this rank's shards to host memory (the stall, all training
waits for), then writes them on a thread while training goes on; its collectives go over a gloo group of their own,
never the one training's collectives use. One save is in flight at a time: the next save (or the end of `fit`)
waits for it first, so a pending save costs one extra copy of each rank's shards in host memory."""

from __future__ import annotations

import shutil
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SHARDED_META = "meta.pt"  # a distributed checkpoint's non-tensor part, as Lightning names it


@dataclass
class Pending:
    """A save whose shards are (being) written to `tmp`; `finish` puts it at `path`."""

    tmp: Path
    path: Path
    meta: dict[str, Any]  # the checkpoint less its tensors, written by rank 0 last
    written: Future | None  # None: written already (a synchronous save)


def start(state: dict[str, Any], meta: dict[str, Any], path: Path, rank: int, barrier, group=None) -> Pending:
    """Write `state` (the weights and optimizer states, sharded) towards `path`, `meta` (the rest) to follow. With a
    `group` (gloo), asynchronously: returns once this rank's shards are copied to host memory."""
    from torch.distributed.checkpoint import async_save, save

    tmp = path.with_name(f".{path.name}.tmp")  # no `*.ckpt` glob ever matches it
    if rank == 0:  # a killed save's leftovers
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    if group is None:
        save(state, checkpoint_id=tmp)
        return Pending(tmp, path, meta, None)
    return Pending(tmp, path, meta, async_save(state, checkpoint_id=tmp, process_group=group))


def finish(pending: Pending, rank: int) -> None:
    """Wait for the shards (on rank 0 DCP writes `.metadata` once every rank's are in), then rank 0 writes `meta.pt`
    and swaps the folder into place: `path` is the old checkpoint or the complete new one, but for the instant
    between two renames, when it is neither and the older checkpoints beside it serve."""
    if pending.written is not None:
        pending.written.result()
    if rank != 0:
        return
    torch.save(pending.meta, pending.tmp / SHARDED_META)
    old = pending.path.with_name(f".{pending.path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if pending.path.is_dir():
        pending.path.rename(old)
    elif pending.path.exists():  # a single-file checkpoint of the same name
        pending.path.unlink()
    pending.tmp.rename(pending.path)
    shutil.rmtree(old, ignore_errors=True)
