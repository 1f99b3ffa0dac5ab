"""Which checkpoint a run continues from, and whether it may: the newest complete one under `resume=auto` (or a
requeued submitit job), checked to fit the configured model and to have run under the same LR schedule; or, with
`init_from`, only another run's weights, under a schedule, optimizer and step count of this run's own. Loaded only
by a run that may start from a checkpoint (`train.py`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from steadylm.checkpointing import CheckpointError, describe_sharded, is_complete, safe_load
from steadylm.errors import ConfigError
from steadylm.schedule import Schedule

log = logging.getLogger("steadylm")


def latest_checkpoint(folder: str | os.PathLike) -> Path | None:
    """The most recently written complete `*.ckpt` in `folder`, a file or a distributed checkpoint's folder (temp
    files and broken ones skipped)."""
    for path in sorted(Path(folder).glob("*.ckpt"), key=lambda p: p.stat().st_mtime_ns, reverse=True):
        if is_complete(path):
            return path
        log.warning("resume=auto: skipping %s (incomplete or corrupt)", path)
    return None


def check_compatible(ckpt: dict, path: str | os.PathLike, module: torch.nn.Module) -> None:
    """Refuse, naming the keys, a checkpoint whose weights do not fit the configured model."""
    theirs = ckpt.get("state_dict")
    if not isinstance(theirs, dict):
        raise CheckpointError(f"{path}: has no 'state_dict'; it is not a steadylm/Lightning training checkpoint")
    ours = module.state_dict()
    missing = [k for k in ours if k not in theirs]  # state_dict order: the model's own names first
    unexpected = [k for k in theirs if k not in ours]
    wrong = [k for k in ours if k in theirs and theirs[k].shape != ours[k].shape]
    wrong = [f"{k} {tuple(theirs[k].shape)} vs {tuple(ours[k].shape)}" for k in wrong]
    named = (("shape mismatch (checkpoint vs config)", wrong), ("missing", missing), ("unexpected", unexpected))
    parts = [f"{what}: " + ", ".join(keys[:4]) + (" ..." if len(keys) > 4 else "") for what, keys in named if keys]
    if not parts:
        return
    model = (ckpt.get("steadylm") or {}).get("config", {}).get("model")
    fix = "use the model config it was trained with"
    if isinstance(model, dict):
        fix = "use the model overrides it was trained with: " + " ".join(f"model.{k}={v}" for k, v in model.items())
    raise CheckpointError(f"{path}: was written for a different model shape ({'; '.join(parts)}); {fix}")


def check_resume(saved_optim: Mapping | None, schedule: Schedule, applied: int, where: str) -> None:
    """Refuse to resume `applied` steps under a schedule that would have given them other LRs; changing only the
    length (or `min_lr`) is an anneal, allowed while every step taken is before both schedules' decay."""
    if not saved_optim:
        return
    saved = Schedule.from_optim(saved_optim)
    # What the LR before `decay_start` depends on (not the length, not `min_lr`).
    same_head = (saved.lr, saved.warmup_steps, saved.shape) == (schedule.lr, schedule.warmup_steps, schedule.shape)
    # The first applied step `schedule` gives another LR; none: the run goes on as if it had been this schedule's.
    start = min(saved.decay_start, schedule.decay_start) if same_head else 0
    step = next((s for s in range(start, applied) if saved(s) != schedule(s)), None) if saved != schedule else None
    if step is None:
        return
    if not same_head:
        fix = (
            f"resume with the checkpoint's optim.schedule={saved.shape} optim.lr={saved.lr:g} "
            f"optim.warmup_steps={saved.warmup_steps}"
        )
    elif saved.shape == "wsd":
        fix = f"anneal from a checkpoint saved at or before step {step}, or keep optim.total_steps={saved.total_steps}"
    else:
        fix = (
            f"keep optim.total_steps={saved.total_steps} (the LR then stays at optim.min_lr past it); only "
            "optim.schedule=wsd can be annealed to another length"
        )
    raise ConfigError(
        f"{where} has {applied} applied steps under {saved.describe()}; this run's {schedule.describe()} would have "
        f"given step {step} LR {schedule(step):.4g}, not {saved(step):.4g}; {fix}"
    )


def checkpoint_to_resume(cfg, module: torch.nn.Module) -> str | None:
    """`ckpt_path=<file>`, or `resume=auto`: the newest good checkpoint in this run's `checkpoints/` (a fresh
    start if none), as a requeued submitit job does by itself (the launcher cannot add it to the command); checked
    to load safely, fit `module` and match its schedule. With nothing to resume, `init_from=<file>` loads that
    checkpoint's weights into `module` (a run that resumes continues from its own checkpoint instead)."""
    ckpt_path, resume, init_from = cfg.get("ckpt_path"), cfg.get("resume"), cfg.get("init_from")
    if init_from and ckpt_path:
        raise CheckpointError("both ckpt_path and init_from are set; ckpt_path resumes a run, init_from starts one")
    if resume not in (None, "auto"):
        raise CheckpointError(
            f"resume={resume} is not supported; use resume=auto, or ckpt_path=<file> for a given checkpoint"
        )
    if resume == "auto" and ckpt_path:
        raise CheckpointError("both ckpt_path and resume=auto are set; pass only one of them")
    folder = Path(cfg.paths.output_dir) / "checkpoints"
    how = "resume=auto" if resume else "submitit requeued this job" if os.environ.get("SUBMITIT_EXECUTOR") else None
    if how and (found := latest_checkpoint(folder)):
        log.info("%s: continuing from %s", how, found)
        ckpt_path = found
    elif resume:
        log.info("resume=auto: no checkpoint in %s, starting from scratch", folder)
    if not ckpt_path:
        if init_from:
            init_weights_from(init_from, module)
        return None
    # mmap: no second full read into RAM; a distributed checkpoint: its shapes alone
    ckpt = describe_sharded(Path(ckpt_path)) if Path(ckpt_path).is_dir() else safe_load(ckpt_path, mmap=True)
    check_compatible(ckpt, ckpt_path, module)
    meta = ckpt.get("steadylm") or {}
    applied = int(ckpt.get("global_step", 0)) - int(meta.get("skipped_steps", 0))
    check_resume((meta.get("config") or {}).get("optim"), module.schedule, applied, f"ckpt_path={ckpt_path}")
    return str(ckpt_path)


def init_weights_from(path: str, module: torch.nn.Module) -> None:
    """`init_from=<file>`: the checkpoint's weights, checked to fit `module`; its optimizer state, LR schedule, step
    count and data position are left behind (a new schedule from step 0: a restart, a fine-tune)."""
    if Path(path).is_dir() and not (Path(path) / ".metadata").exists():  # .metadata: a distributed checkpoint
        raise CheckpointError(
            f"init_from={path} is a folder: init_from takes a steadylm checkpoint file; a Hugging Face model folder "
            f"is model.init_from={path}, which also sets the model's shape from its config.json"
        )
    ckpt = safe_load(path, mmap=True)
    check_compatible(ckpt, path, module)
    module.load_state_dict(ckpt["state_dict"])
    module.weights_from = str(path)
    log.info(
        "init_from: the weights of %s (step %d); optimizer and LR schedule start fresh",
        path,
        ckpt.get("global_step", 0),
    )
