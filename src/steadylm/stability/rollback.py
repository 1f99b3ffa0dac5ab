"""Roll back in place, mid-`fit`, to the newest checkpoint in the run dir at or before the first bad step with only
finite weights (`Recovery`'s fallback when it holds no snapshot); the data since is skipped (as PaLM did by hand).
Every rank reads the same checkpoint: replicas stay equal, and under FSDP2 each rank loads its own shards of a
distributed checkpoint (Lightning's `load_checkpoint`), the whole model never gathered on one rank."""

from __future__ import annotations

from pathlib import Path

import torch

from steadylm.checkpointing import SHARDED_META, STABILITY_STATE_KEY, CheckpointError, is_complete, safe_load
from steadylm.distributed import is_sharded, local, reshard


def checkpoint_dir(trainer) -> Path:
    cb = trainer.checkpoint_callback
    if cb is not None and getattr(cb, "dirpath", None):
        return Path(cb.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


def _candidates(trainer, sharded: bool, at_or_before: int) -> list[tuple[int, Path]]:
    """(step, path) of each readable checkpoint at or before the step, newest first; rank 0's list, broadcast."""
    found = []
    if trainer.global_rank == 0 or not sharded:
        for path in checkpoint_dir(trainer).glob("*.ckpt"):
            if path.is_dir() != sharded or not is_complete(path):  # a half-written or foreign one: not a candidate
                continue
            try:
                step = int(safe_load(path / SHARDED_META if sharded else path, mmap=True).get("global_step", -1))
            except CheckpointError:
                continue
            if step <= at_or_before:
                found.append((step, path))
    return sorted(trainer.strategy.broadcast(found) if sharded else found, reverse=True)


def _load(trainer, pl_module, optimizer, path: Path, sharded: bool) -> dict | None:
    """Load the checkpoint into the live model and optimizer if its weights are all finite (on every rank); its
    non-tensor part, or None, nothing loaded (its weights are read and checked first)."""
    if not sharded:
        ckpt = safe_load(path)
        if not all(t.isfinite().all() for t in ckpt["state_dict"].values() if t.is_floating_point()):
            return None
        pl_module.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer_states"][0])
        return ckpt
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    weights = {k: torch.empty_like(v) for k, v in get_model_state_dict(pl_module).items()}  # this rank's shards
    load({"state_dict": weights}, checkpoint_id=path)
    finite = all(bool(local(t).isfinite().all()) for t in weights.values() if t.is_floating_point())
    if not trainer.strategy.reduce_boolean_decision(finite, all=True):
        return None
    reshard(pl_module)  # the next forward gathers the loaded shards
    return trainer.strategy.load_checkpoint(path)


def rollback(trainer, pl_module, optimizer, at_or_before: int) -> dict | None:
    """Restore in place; returns `Recovery.rollback`'s restore from "disk", or None without a good checkpoint."""
    sharded = is_sharded(trainer.strategy)
    for _, path in _candidates(trainer, sharded, at_or_before):
        if (ckpt := _load(trainer, pl_module, optimizer, path, sharded)) is not None:
            break
    else:
        return None
    step = int(ckpt["global_step"])
    # The optimizer steps whose update is in its weights: less one when its last step was skipped on the device
    # and not yet counted when it was saved (a non-finite measurement still pending).
    applied = step - int(ckpt.get("steadylm", {}).get("skipped_steps", 0))
    pending = ((ckpt.get("callbacks", {}).get(STABILITY_STATE_KEY) or {}).get("measure") or {}).get("pending")
    if pending and (pending["loss_nonfinite"] or pending["grad_nonfinite"]):
        applied -= 1
    return {"source": "disk", "checkpoint": path.name, "to_step": step, "applied": applied, "detectors": {}}
