"""Hydra + Lightning's multi-process strategies: one run dir, one writer, no sweep inside a sweep. Lightning's
DDP launcher re-runs `train.py` per extra process with rank 0's `hydra.run.dir`; under `-m` its command line would be
the whole sweep's, so `job_processes` hands it the running job's instead. This also adds FSDP's own clipping.
Launching stays with Lightning, torchrun, submitit."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import lightning as L
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.strategies import FSDPStrategy
from omegaconf import read_write

from steadylm.compat import relaunches_script

# Set for the extra processes of one job of a multirun (its folder): they fail, diverge and stop as a sweep job does.
SWEEP_JOB_ENV = "STEADYLM_SWEEP_JOB"
# What Lightning's launcher writes into this process's environment for its children; a later job needs it gone
# (`LOCAL_RANK` alone makes Lightning take the processes as started by someone else).
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", SWEEP_JOB_ENV)


def is_rank_zero_process() -> bool:
    """No rank variable (torchrun's, SLURM's, Lightning's launcher's) names a non-zero rank: before any group."""
    return all(os.environ.get(var, "0") == "0" for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))


def in_multirun() -> bool:
    """A job of a Hydra multirun, or an extra process of one (which Hydra itself runs as a single run)."""
    return bool(os.environ.get(SWEEP_JOB_ENV)) or (
        HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    )


@contextmanager
def job_processes(trainer: L.Trainer) -> Iterator[None]:
    """Around `fit` of a multirun job on several devices: Lightning's launcher builds each extra process's command
    from `sys.argv` (with `-m` and every sweep list) and `hydra.run.dir`, so both become this job's own (its task
    overrides as a single run, its folder); afterwards the job's process group and launch variables go, so the next
    job starts its own processes on a fresh port. Anything else passes through untouched."""
    strategy = trainer.strategy
    relaunches = relaunches_script(strategy) and not strategy.cluster_environment.creates_processes_externally
    if not (HydraConfig.initialized() and in_multirun() and relaunches and trainer.num_devices > 1):
        yield
        return
    hydra = HydraConfig.get()
    folder, argv = str(hydra.runtime.output_dir), sys.argv
    saved = {key: os.environ.get(key) for key in LAUNCH_ENV}
    sys.argv = [argv[0], *hydra.overrides.task, "hydra.mode=RUN"]  # an Optuna config asks for MULTIRUN itself
    with read_write(hydra):
        hydra.run.dir = folder
    os.environ[SWEEP_JOB_ENV] = folder
    try:
        yield
    finally:
        sys.argv = argv
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


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
