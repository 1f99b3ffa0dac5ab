"""Hydra + Lightning's multi-process strategies: one run dir, one writer, no sweep inside a sweep. Lightning's
DDP launcher re-runs `train.py` per extra process with rank 0's `hydra.run.dir`; a sweep job's processes are started
by the job (jobs.py, under torch's elastic launcher). `FSDP2Strategy` is Lightning's `ModelParallelStrategy` with
every process one data-parallel shard, and `local` is a sharded tensor's own slice, which the stability suite
measures, snapshots and restores without gathering. Launching stays with Lightning, torchrun, submitit."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from steadylm import sharded_save
from steadylm.compat import pg_timeout, saves_sharded

log = logging.getLogger("steadylm")

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


class FSDP2Strategy(ModelParallelStrategy):
    """FSDP2 (`fully_shard`, applied by `LMModule.configure_model`) over every process: `ModelParallelStrategy`'s
    "auto" data-parallel size is the number of nodes (tensor parallelism within each), here it is the world size.
    Its distributed checkpoints are swapped into place whole and, with `async_save`, written while training goes on
    (sharded_save.py); each save's stall is logged."""

    def __init__(self, async_save: bool = True, **kwargs) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)
        self.async_save, self._save_group, self._pending = async_save, None, None

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()
        if self.async_save:  # the writing thread's collectives: never in the way of training's
            self._save_group = torch.distributed.new_group(backend="gloo", timeout=pg_timeout(self))

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        if not saves_sharded(self):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        began = time.perf_counter()
        self.finish_save()  # one save in flight at a time
        path = Path(self.broadcast(str(filepath)))
        state = {"state_dict": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        self._pending = sharded_save.start(state, checkpoint, path, self.global_rank, self.barrier, self._save_group)
        how = "its shards are written in the background" if self._pending.written else "written"
        if self._pending.written is None:
            self.finish_save()
        if self.global_rank == 0:
            log.info("checkpoint %s: training waited %.2f s (%s)", path.name, time.perf_counter() - began, how)

    def finish_save(self) -> None:
        """The save in flight, if any, complete and in place."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            sharded_save.finish(pending, self.global_rank)

    def teardown(self) -> None:
        self.finish_save()  # the last checkpoint lands before `fit` returns, or an exception ends the run
        super().teardown()


def is_sharded(strategy) -> bool:
    """The parameters are DTensors sharded over the ranks (FSDP2), not whole replicas."""
    return isinstance(strategy, ModelParallelStrategy)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's slice of a sharded tensor (a view of its storage), the tensor itself otherwise."""
    return t.to_local() if isinstance(t, DTensor) else t


def reshard(module: torch.nn.Module) -> None:
    """Free every FSDP unit's gathered weights. FSDP2 keeps the root's gathered after a forward (the backward in
    training needs them next) and a forward outside training has no backward to free them: without this, the next
    forward would reuse them after the shards changed (an update, a restore)."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()


def sharding(t: torch.Tensor) -> tuple | None:
    """What `from_local` needs to make a sharded tensor of a copy of its slice again; None: not sharded."""
    return (t.device_mesh, t.placements, t.shape, t.stride()) if isinstance(t, DTensor) else None


def from_local(t: torch.Tensor, spec: tuple | None) -> torch.Tensor:
    """`t` (a slice's copy) as the sharded tensor `spec` describes (`sharding`); `t` itself when `spec` is None."""
    if spec is None:
        return t
    mesh, placements, shape, stride = spec
    return DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
