"""Roll back in place, mid-`fit`, to the newest checkpoint in the run dir at or before the first bad step with only
finite weights (`Recovery`'s fallback when it holds no snapshot); the data since is skipped (as PaLM did by hand).
Every rank reads the same file: the replicas stay equal."""

from __future__ import annotations

from pathlib import Path

from steadylm.checkpointing import STABILITY_STATE_KEY, CheckpointError, safe_load


def checkpoint_dir(trainer) -> Path:
    cb = trainer.checkpoint_callback
    if cb is not None and getattr(cb, "dirpath", None):
        return Path(cb.dirpath)
    return Path(trainer.default_root_dir) / "checkpoints"


def rollback(trainer, pl_module, optimizer, at_or_before: int) -> dict | None:
    """Restore in place; returns `Recovery.rollback`'s restore from "disk", or None without a good checkpoint."""
    best: tuple[Path, dict] | None = None
    for path in sorted(p for p in checkpoint_dir(trainer).glob("*.ckpt") if p.is_file()):
        try:
            ckpt = safe_load(path)
        except CheckpointError:  # a half-written or foreign file is simply not a candidate
            continue
        step = int(ckpt.get("global_step", -1))
        if step > at_or_before or (best is not None and step <= best[1]["global_step"]):
            continue
        if all(t.isfinite().all() for t in ckpt["state_dict"].values() if t.is_floating_point()):
            best = (path, ckpt)
    if best is None:
        return None
    path, ckpt = best
    step = int(ckpt["global_step"])
    pl_module.load_state_dict(ckpt["state_dict"])
    optimizer.load_state_dict(ckpt["optimizer_states"][0])
    # The optimizer steps whose update is in its weights: less one when its last step was skipped on the device
    # and not yet counted when it was saved (a non-finite measurement still pending).
    applied = step - int(ckpt.get("steadylm", {}).get("skipped_steps", 0))
    pending = ((ckpt.get("callbacks", {}).get(STABILITY_STATE_KEY) or {}).get("measure") or {}).get("pending")
    if pending and (pending["loss_nonfinite"] or pending["grad_nonfinite"]):
        applied -= 1
    return {"source": "disk", "checkpoint": path.name, "to_step": step, "applied": applied, "detectors": {}}
