"""A job of a Hydra multirun (`-m`), loaded only by one (`train.py`): the job's own extra processes when it runs on
several devices, and the skip of a job that `resume=auto` finds finished."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning as L
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, read_write

from steadylm.compat import relaunches_script
from steadylm.distributed import SWEEP_JOB_ENV
from steadylm.result import RESULT_FILE

# What Lightning's launcher writes into this process's environment for its children; a later job needs it gone
# (`LOCAL_RANK` alone makes Lightning take the processes as started by someone else).
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", SWEEP_JOB_ENV)


@contextmanager
def job_processes(trainer: L.Trainer) -> Iterator[None]:
    """Around `fit` of a multirun job on several devices: Lightning's launcher builds each extra process's command
    from `sys.argv` (with `-m` and every sweep list) and `hydra.run.dir`, so both become this job's own (its task
    overrides as a single run, its folder); afterwards the job's process group and launch variables go, so the next
    job starts its own processes on a fresh port. Anything else passes through untouched."""
    strategy = trainer.strategy
    relaunches = relaunches_script(strategy) and not strategy.cluster_environment.creates_processes_externally
    if not (HydraConfig.initialized() and relaunches and trainer.num_devices > 1):
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


def finished_job(cfg: DictConfig) -> tuple[float | None, str] | None:
    """A sweep job that `resume=auto` finds already finished (`result.json` other than preempted): the metric it
    handed the sweeper and its status, so the job is skipped, not retrained; None when it has to run."""
    path = Path(cfg.paths.output_dir) / RESULT_FILE
    if cfg.get("resume") != "auto" or not path.is_file():
        return None
    result = json.loads(path.read_text())
    if result.get("status") == "preempted":
        return None
    metric = cfg.get("optimized_metric")
    value = None if not metric else float("nan") if result["status"] == "diverged" else result.get("val_loss")
    return value, result["status"]
