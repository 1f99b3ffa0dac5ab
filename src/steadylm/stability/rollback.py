"""Roll back to the last good checkpoint in the run dir, in place, in the middle of `fit`.

Restores the weights, optimizer state, LR scheduler and skipped-step count from the newest checkpoint
that was saved at or before the first bad step and holds only finite weights. The data loader is not
rewound: the window between that checkpoint and now is skipped, as PaLM did by hand. Every rank reads
the same file after the same collective decision, so the replicas stay identical.
"""

from __future__ import annotations

from pathlib import Path

import torch


def checkpoint_dir(trainer) -> Path:
    cb = trainer.checkpoint_callback
    if cb is not None and getattr(cb, "dirpath", None):
        return Path(cb.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


def last_good_checkpoint(trainer, at_or_before: int) -> tuple[Path, dict] | None:
    files = sorted(checkpoint_dir(trainer).glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True)
    best: tuple[Path, dict] | None = None
    for path in files:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        step = int(ckpt.get("global_step", -1))
        if step > at_or_before or (best is not None and step <= best[1]["global_step"]):
            continue
        if all(t.isfinite().all() for t in ckpt["state_dict"].values() if t.is_floating_point()):
            best = (path, ckpt)
    return best


def rollback(trainer, pl_module, optimizer, at_or_before: int) -> dict | None:
    """Restore in place; returns {"checkpoint", "to_step"} or None when no good checkpoint exists."""
    found = last_good_checkpoint(trainer, at_or_before)
    if found is None:
        return None
    path, ckpt = found
    pl_module.load_state_dict(ckpt["state_dict"])
    optimizer.load_state_dict(ckpt["optimizer_states"][0])
    if trainer.lr_scheduler_configs and ckpt.get("lr_schedulers"):
        trainer.lr_scheduler_configs[0].scheduler.load_state_dict(ckpt["lr_schedulers"][0])
    pl_module.skipped_steps = int(ckpt.get("steadylm", {}).get("skipped_steps", 0))
    return {"checkpoint": path.name, "to_step": int(ckpt["global_step"])}
