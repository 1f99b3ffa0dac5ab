"""The config resolved once, before anything is built, then read-only: nothing re-derives or changes a value.

1. null `model.vocab_size`, `data.tokenizer` (from the DataModule) and `optim.warmup_steps` (derived.py);
2. the config's refusals (config.py `validate_config`);
3. the devices (devices.py), `trainer.accumulate_grad_batches` (global_batch.py), a null `val_check_interval`;
4. the precision (precision.py), this machine's refusals and the memory plan (preflight.py).

Steps 1 and 3 write the config (so checkpoints record them); devices and precision stay `auto` for a resume elsewhere.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from steadylm.config import set_key, validate_config
from steadylm.derived import data_source, from_data, from_run_length, val_interval
from steadylm.devices import Devices, devices_of
from steadylm.global_batch import KEY, accumulation
from steadylm.memory import MemoryPlan
from steadylm.precision import resolve_precision
from steadylm.preflight import check_environment


@dataclass(frozen=True)
class Resolved:
    cfg: DictConfig
    datamodule: Any  # set up, a `DataSource` (data/source.py)
    devices: Devices
    precision: str  # Lightning's "<dtype>-<mode>" name, `auto` resolved for this machine
    memory: MemoryPlan


def fill(cfg: DictConfig, values: dict[str, Any]) -> None:
    """Write `values` (dotted key -> value) that differ, so a resolved config resolves again unchanged."""
    for key, value in values.items():
        if OmegaConf.select(cfg, key) != value:
            set_key(cfg, key, value)


def fill_derived(cfg: DictConfig) -> Any | None:
    """Step 1 alone (doctor, tests); the DataModule it built for the vocabulary (None when that is set)."""
    dm = data_source(cfg) if cfg.model.get("vocab_size") is None else None
    fill(cfg, {**from_data(cfg, dm), **from_run_length(cfg)})
    return dm


def resolve(cfg: DictConfig) -> Resolved:
    """Fill, check and freeze `cfg` in place (steps 1-4 above); the DataModule is built once, last unless step 1."""
    dm = fill_derived(cfg)
    validate_config(cfg)
    devices = devices_of(cfg)
    accumulate = accumulation(cfg, devices.world_size)
    fill(cfg, {KEY: accumulate, **val_interval(cfg, accumulate)})
    precision = resolve_precision(cfg.trainer.precision, devices.accelerator)
    memory = check_environment(cfg, devices, precision)
    datamodule = dm if dm is not None else data_source(cfg)
    OmegaConf.set_readonly(cfg, True)
    return Resolved(cfg, datamodule, devices, precision, memory)


def with_keys(run: Resolved, keys: dict[str, Any]) -> Resolved:
    """`run` with `keys` set in a read-only copy of its config, nothing derived again (a benchmark's Trainers of
    other lengths around one module and DataModule)."""
    cfg = copy.deepcopy(run.cfg)
    OmegaConf.set_readonly(cfg, False)
    fill(cfg, keys)
    OmegaConf.set_readonly(cfg, True)
    return replace(run, cfg=cfg)
