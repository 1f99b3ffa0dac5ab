"""The config resolved once, before anything is built, then read-only: nothing re-derives or changes a value. The
derived keys (derived.py) are written into the config, so checkpoints record them; the devices and precision
(devices.py) are resolved beside it, which keeps `auto` for a resume elsewhere, with this machine's refusals."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from steadylm.config import set_key, validate_config
from steadylm.derived import KEY, accumulation, data_source, from_data, from_run_length, val_interval
from steadylm.devices import Devices, devices_of, resolve_precision
from steadylm.errors import ConfigError
from steadylm.memory import MemoryPlan, advice, plan


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
    """The vocabulary, tokenizer and warmup alone (doctor, tests); the DataModule built for the vocabulary, or None.
    First a published model's shape (`model.init_from`), whose vocabulary is the one the data must fit."""
    if cfg.model.get("init_from") is not None:
        from steadylm.model.hf import pretrained_shape  # loaded only by a run that starts from a published model

        fill(cfg, pretrained_shape(cfg))
    dm = data_source(cfg) if cfg.model.get("vocab_size") is None else None
    fill(cfg, {**from_data(cfg, dm), **from_run_length(cfg)})
    return dm


def check_epoch(cfg: DictConfig, datamodule: Any, world_size: int, accumulate: int) -> None:
    """`data.drop_last=true` drops an epoch's last partial optimizer step, so an epoch shorter than one step would
    run none (Lightning's "No training batches"): refused here, where the step's windows are known. A mixture's
    epoch is whole steps already (data/mixture.py)."""
    windows, batch = getattr(datamodule, "n_train_windows", None), int(datamodule.batch_size)
    if not getattr(datamodule, "drop_last", False) or getattr(datamodule, "sources", None) or windows is None:
        return
    if windows < (step := batch * world_size * accumulate):
        tokens = cfg.data.get("global_batch_tokens")
        by, lower = (f" from data.global_batch_tokens={tokens}", "data.global_batch_tokens") if tokens else ("", KEY)
        raise ConfigError(
            f"data.drop_last=true drops an epoch's last partial optimizer step, and the {windows:,} train windows are "
            f"fewer than one step's {step:,} (data.batch_size={batch} x {world_size} device(s) x {KEY}={accumulate}"
            f"{by}), so no step would run; set data.drop_last=false, or lower data.batch_size or {lower}"
        )


def check_environment(cfg: DictConfig, devices: Devices, precision: str, batch_size: int) -> MemoryPlan:
    """Refuse what Lightning would run quietly otherwise (`auto` devices without a GPU: CPU processes; fp16 off CUDA:
    bf16), a run that does not fit, an output folder that cannot be written; the memory plan that fits."""
    n, accelerator, fp = devices.per_node, cfg.trainer.accelerator, str(cfg.trainer.precision)
    if str(accelerator) == "auto" and devices.accelerator == "cpu" and n > 1:
        raise ConfigError(
            f"trainer.devices={cfg.trainer.devices} asks for {n} GPUs but 0 are visible on this machine; "
            f"set trainer.devices=1, or trainer.accelerator=cpu to run {n} CPU processes on purpose"
        )
    if fp in ("16-mixed", "16") and not devices.on_cuda:
        raise ConfigError(
            f"trainer.precision={fp} (fp16 with a loss scaler) needs a CUDA GPU and none is in use here "
            f"(trainer.accelerator={accelerator}); use trainer.precision=bf16-mixed or 32-true"
        )
    if not (memory := plan(cfg, precision, devices, batch_size)).fits:
        raise ConfigError(f"this run does not fit: {memory.describe()}; {advice(cfg, precision, devices, batch_size)}")
    folder = Path(cfg.paths.output_dir)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise ConfigError(
            f"paths.output_dir={folder} is not writable ({e.strerror or e}); "
            "point it (or hydra.run.dir) at a folder you can write"
        ) from None
    return memory


def check_tokenizer(folder: str | Path, data_tokenizer: str) -> None:
    """Refuse data tokenized otherwise than `folder`'s tokenizer.json (the DataModule's `tokenizer_name`, the spec
    its shards record); a folder without one is trusted to the vocabulary check alone."""
    from steadylm.data.tokenizer import same_tokenizer
    from steadylm.model.hf import tokenizer_file

    if (theirs := tokenizer_file(folder)) is not None and not same_tokenizer(str(data_tokenizer), theirs):
        raise ConfigError(
            f"model.init_from={folder} reads ids of its {theirs.name}, but the data was tokenized by "
            f"{data_tokenizer!r}; prepare it with the model's: python -m steadylm.data.prepare data.tokenizer={folder} "
            "data.dir=<a new folder>, and train with that data.dir"
        )


def resolve(cfg: DictConfig) -> Resolved:
    """Fill, check and freeze `cfg` in place; the DataModule is built once (first when the vocabulary needs it), and
    asked for the batch size (never the shard DataModule's `data.*` keys, which a custom source may not have)."""
    dm = fill_derived(cfg)
    validate_config(cfg)
    datamodule = dm if dm is not None else data_source(cfg)
    if cfg.model.get("init_from") is not None:  # the data tokenized as the published model reads
        check_tokenizer(cfg.model.init_from, datamodule.tokenizer_name)
    devices = devices_of(cfg)
    accumulate = accumulation(cfg, devices.world_size, datamodule.batch_size)
    fill(cfg, {KEY: accumulate, **val_interval(cfg)})
    check_epoch(cfg, datamodule, devices.world_size, accumulate)
    precision = resolve_precision(cfg.trainer.precision, devices.accelerator)
    memory = check_environment(cfg, devices, precision, datamodule.batch_size)
    OmegaConf.set_readonly(cfg, True)
    return Resolved(cfg, datamodule, devices, precision, memory)
