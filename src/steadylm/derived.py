"""Keys that follow from something else, as functions that return the values (`resolve.py` writes them, once); a key
the user sets keeps its value. A null vocabulary and tokenizer follow the data (data/source.py), warmup and the
validation interval the run length; `data.global_batch_tokens` sets `trainer.accumulate_grad_batches` for this many
devices, so a recipe trains the same on 1 GPU or 64: never rounded, never overriding a hand-set value silently."""

from __future__ import annotations

import logging
import math
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf

from steadylm.config import validate_values
from steadylm.data.source import missing_members
from steadylm.errors import ConfigError, SteadyError, one_line

log = logging.getLogger("steadylm")
KEY = "trainer.accumulate_grad_batches"


def padded_vocab(vocab_size: int) -> int:
    return -(-int(vocab_size) // 64) * 64  # the smallest multiple of 64 that holds `vocab_size` ids


def warmup_steps(max_steps: int) -> int:
    return min(100, int(max_steps) // 10)  # at most 100 steps, at most a tenth of the run


def val_every_steps(max_steps: int) -> int:
    return max(1, min(200, math.ceil(int(max_steps) / 5)))  # every 200 steps at most, at least 5 times a run


def data_source(cfg: DictConfig) -> Any:
    """The DataModule `cfg.data` names, set up: a source's refusal (`SteadyError`) as its own one line."""
    validate_values(cfg, "data.")
    try:
        dm = instantiate(cfg.data)
    except MissingMandatoryValue as err:  # a `???` key of the data config (data=hf_stream's data.name)
        raise ConfigError(f"{err.full_key} is required by this data config: set {err.full_key}=...") from None
    except InstantiationException as err:
        if isinstance(err.__cause__, SteadyError):
            raise err.__cause__ from None
        cause = err.__cause__ or err
        raise ConfigError(
            f"data: cannot build {cfg.data.get('_target_')} ({type(cause).__name__}: {one_line(cause)}); "
            "check the data.* keys"
        ) from None
    if missing := missing_members(dm):
        need = "a data source needs the members of steadylm.data.source.DataSource (src/steadylm/data/source.py)"
        raise ConfigError(f"data._target_={cfg.data.get('_target_')} lacks {', '.join(missing)}: {need}")
    dm.setup("fit")  # the source's own checks, before anything else is built
    return dm


def from_data(cfg: DictConfig, dm: Any | None) -> dict[str, Any]:
    """A null vocabulary from `dm`, and a null tokenizer with it; data keys that interpolate `data.tokenizer` (the
    default data.dir) keep their value: filling the tokenizer must not move the folder just read."""
    if cfg.model.get("vocab_size") is not None:
        return {}
    values: dict[str, Any] = {"model.vocab_size": padded_vocab(dm.vocab_size)}
    if cfg.data.get("tokenizer") is None:
        raw = OmegaConf.to_container(cfg.data, resolve=False)
        values |= {f"data.{k}": cfg.data[k] for k, v in raw.items() if isinstance(v, str) and "{data.tokenizer}" in v}
        values["data.tokenizer"] = dm.tokenizer_name
    return values


def from_run_length(cfg: DictConfig) -> dict[str, Any]:
    """A null `optim.warmup_steps` (nothing for a bad `trainer.max_steps`: validate_config names it)."""
    max_steps = cfg.trainer.max_steps
    if cfg.optim.get("warmup_steps") is not None or type(max_steps) is not int or max_steps < 1:
        return {}
    return {"optim.warmup_steps": warmup_steps(max_steps)}


def val_interval(cfg: DictConfig) -> dict[str, Any]:
    """A null `trainer.val_check_interval`, in optimizer steps (`val_check_batches` turns it into Lightning's)."""
    if cfg.trainer.get("val_check_interval") is not None:
        return {}
    return {"trainer.val_check_interval": val_every_steps(cfg.trainer.max_steps)}


def val_check_batches(trainer: DictConfig) -> dict[str, Any]:
    """Steps in the config, micro-batches in Lightning: the same validation steps at any accumulation (a float as is)."""
    every = trainer.get("val_check_interval")
    return {"val_check_interval": every * int(trainer.accumulate_grad_batches)} if type(every) is int else {}


def accumulation(cfg: DictConfig, world_size: int, batch_size: int) -> int:
    """global_batch_tokens / (world_size × batch × context), or the config's accumulation when that is null;
    `batch_size`: the DataModule's (`DataSource.batch_size`)."""
    total, current = cfg.data.get("global_batch_tokens"), cfg.trainer.get("accumulate_grad_batches", 1)
    if total is None:
        return current
    B, T = int(batch_size), int(cfg.model.context_length)
    micro = world_size * B * T
    shown = f"devices×batch×context = {world_size}×{B}×{T} = {micro:,}"
    if type(total) is not int or total <= 0:
        raise ConfigError(
            f"data.global_batch_tokens={total!r} must be a whole number of tokens > 0 (e.g. 524288), or null"
        )
    if total % micro:
        lo, hi = total // micro * micro, -(-total // micro) * micro
        use = f"{lo:,} or {hi:,}" if lo else f"{hi:,}"
        raise ConfigError(
            f"data.global_batch_tokens={total} is not a multiple of {shown}; use {use} tokens, "
            "or a batch size (data.batch_size) that divides it"
        )
    accum = total // micro
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []  # [] for a config by hand
    if current != accum and (current != 1 or any(o.lstrip("+~").split("=", 1)[0] == KEY for o in overrides)):
        raise ConfigError(
            f"{KEY}={current} contradicts data.global_batch_tokens={total}, which needs {accum} "
            f"({total:,} / {shown}); set only one of them"
        )
    log.info("data.global_batch_tokens=%s: %s=%d (%s per micro-step)", f"{total:,}", KEY, accum, shown)
    return accum
