"""The config resolved once, before anything is built, then made read-only: `resolve(cfg) -> Resolved`.

Every value that follows from something else is settled here, in one step, from the composed config and the
DataModule, and the build reads only the result: the model, the Trainer and the callbacks never re-derive a
value, and none can change `cfg` afterwards (a write raises `omegaconf.errors.ReadonlyConfigError`). In order,
each from what is final before it:

1. `model.vocab_size` and `data.tokenizer` from the DataModule, `optim.warmup_steps` from the run length
   (derived.py), when they are null; `fill_derived` is this step alone, for doctor and tests;
2. the startup refusals of the config so filled (config.py `validate_config`);
3. the devices and world size (devices.py), then `trainer.accumulate_grad_batches` from
   `data.global_batch_tokens` (global_batch.py) and a null `trainer.val_check_interval` in micro-batches;
4. the precision (precision.py), and the refusals of this machine with the memory plan (preflight.py).

Steps 1 and 3 write the config, so the run config every checkpoint carries shows the filled values. The devices
and precision are not written: the config keeps the user's `auto`, which a resume on another machine resolves
again; `Resolved` carries what they resolved to. The DataModule is built once, when step 1 needs its
vocabulary, else after step 4 (so a config refusal comes before a missing data folder), and the build reuses it.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from steadylm.config import set_key, validate_config
from steadylm.derived import data_source, from_data, from_run_length, val_interval
from steadylm.devices import Devices, devices_of
from steadylm.global_batch import KEY as ACCUMULATE
from steadylm.global_batch import accumulation
from steadylm.memory import MemoryPlan
from steadylm.precision import resolve_precision
from steadylm.preflight import check_environment


@dataclass(frozen=True)
class Resolved:
    """What the build reads: the read-only config and what was resolved beside it."""

    cfg: DictConfig
    datamodule: Any  # set up, a `DataSource` (data/source.py)
    devices: Devices
    precision: str  # Lightning's "<dtype>-<mode>" name, `auto` resolved for this machine
    memory: MemoryPlan


def fill(cfg: DictConfig, values: dict[str, Any]) -> None:
    """Write `values` (dotted key -> value) that differ from the config's, so a resolved config resolves again
    unchanged."""
    for key, value in values.items():
        if OmegaConf.select(cfg, key) != value:
            set_key(cfg, key, value)


def fill_derived(cfg: DictConfig) -> Any | None:
    """Step 1: the null vocabulary, tokenizer and warmup. Returns the DataModule it built for the vocabulary
    (None when `model.vocab_size` is set: nothing here needs the data then)."""
    dm = data_source(cfg) if cfg.model.get("vocab_size") is None else None
    fill(cfg, {**from_data(cfg, dm), **from_run_length(cfg)})
    return dm


def resolve(cfg: DictConfig) -> Resolved:
    """Fill, check and freeze `cfg` in place (steps 1-4 above)."""
    dm = fill_derived(cfg)
    validate_config(cfg)
    devices = devices_of(cfg)
    accumulate = accumulation(cfg, devices.world_size)
    fill(cfg, {ACCUMULATE: accumulate, **val_interval(cfg, accumulate)})
    precision = resolve_precision(cfg.trainer.precision, devices.accelerator)
    memory = check_environment(cfg, devices, precision)
    datamodule = dm if dm is not None else data_source(cfg)
    OmegaConf.set_readonly(cfg, True)
    return Resolved(cfg, datamodule, devices, precision, memory)


def with_keys(run: Resolved, keys: dict[str, Any]) -> Resolved:
    """`run` with `keys` (dotted key -> value) set in a read-only copy of its config, nothing derived again:
    for a benchmark that builds several Trainers of other lengths around one built module and DataModule."""
    cfg = copy.deepcopy(run.cfg)
    OmegaConf.set_readonly(cfg, False)
    fill(cfg, keys)
    OmegaConf.set_readonly(cfg, True)
    return dataclasses.replace(run, cfg=cfg)
