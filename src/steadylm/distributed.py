"""Hydra + Lightning's multi-process strategies: one run dir, one writer, no sweep inside a sweep. Lightning's
DDP launcher re-runs `train.py` per extra process with rank 0's `hydra.run.dir`; this adds FSDP's own clipping and
refuses a multirun whose children would each re-run the sweep. Launching stays with Lightning, torchrun, submitit."""

from __future__ import annotations

import os

import lightning as L
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from lightning.pytorch.strategies import FSDPStrategy

from steadylm.compat import relaunches_script
from steadylm.errors import ConfigError


def is_rank_zero_process() -> bool:
    """No rank variable (torchrun's, SLURM's, Lightning's launcher's) names a non-zero rank: before any group."""
    return all(os.environ.get(var, "0") == "0" for var in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))


def in_multirun() -> bool:
    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def refuse_multirun_multiprocess(trainer: L.Trainer) -> None:
    """Refuse `-m` with a strategy whose launcher re-runs the script (the children would re-run the sweep)."""
    strategy = trainer.strategy
    relaunches = relaunches_script(strategy) and not strategy.cluster_environment.creates_processes_externally
    if in_multirun() and relaunches and trainer.num_devices > 1:
        raise ConfigError(
            f"Hydra multirun (-m) cannot start trainer.devices={trainer.num_devices} processes itself "
            f"({type(strategy).__name__}): Lightning re-runs train.py for each extra process, which would re-run "
            "the whole sweep; sweep with hydra/launcher=slurm (submitit starts every job's processes), or run each "
            "job without -m (e.g. `torchrun --nproc_per_node=N train.py hydra.run.dir=... <overrides>`)."
        )


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
