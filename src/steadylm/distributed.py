"""Hydra + Lightning's multi-process strategies: one run dir, one writer, no sweep inside a sweep. Lightning's
DDP launcher re-runs `train.py` per extra process with rank 0's `hydra.run.dir`; a sweep job's processes are started
by the job (jobs.py, under torch's elastic launcher). This adds FSDP's own clipping. Launching stays with Lightning,
torchrun, submitit."""

from __future__ import annotations

import os

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.strategies import FSDPStrategy

# Set in each rank of a sweep job that jobs.py started (its folder): its job's process reads how it ended.
SWEEP_JOB_ENV = "STEADYLM_SWEEP_JOB"
JOB_PARENT_ENV = "STEADYLM_JOB_PARENT"  # that job's process's pid: a rank dies with it


def is_rank_zero_process() -> bool:
    """No rank variable (torchrun's, SLURM's, Lightning's launcher's) names a non-zero rank: before any group."""
    return all(os.environ.get(var, "0") == "0" for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))


def in_multirun() -> bool:
    """The process of a job of a Hydra multirun (not one of the job's ranks, which Hydra runs as a single run)."""
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def is_job_rank() -> bool:
    """A rank that a sweep job's process started (jobs.py): it leaves the job's outcome to that process."""
    return bool(os.environ.get(SWEEP_JOB_ENV))


class FSDPClipping(L.Callback):
    """Global-norm clipping by the FSDP module (Lightning refuses it there); last: callbacks see pre-clip grads."""

    def __init__(self, max_norm: float):
        self.max_norm = float(max_norm)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        trainer.strategy.model.clip_grad_norm_(self.max_norm)


def use_fsdp_clipping(trainer: L.Trainer) -> None:
    clip = trainer.gradient_clip_val
    if isinstance(trainer.strategy, FSDPStrategy) and clip and trainer.gradient_clip_algorithm == "norm":
        trainer.gradient_clip_val = None
        trainer.callbacks.append(FSDPClipping(clip))
