"""Hydra + Lightning's multi-process strategies: one run dir, one writer, no sweep inside a sweep. Lightning's
DDP launcher re-runs `train.py` per extra process with rank 0's `hydra.run.dir`; a sweep job's processes are started
by the job (jobs.py, under torch's elastic launcher). `FSDP2Strategy` is Lightning's `ModelParallelStrategy` with
every process one data-parallel shard, and `local` is a sharded tensor's own slice, which the stability suite
measures, snapshots and restores without gathering. Launching stays with Lightning, torchrun, submitit."""

from __future__ import annotations

import os

import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

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
    "auto" data-parallel size is the number of nodes (tensor parallelism within each), here it is the world size."""

    def __init__(self, **kwargs) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1, **kwargs)

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()


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
