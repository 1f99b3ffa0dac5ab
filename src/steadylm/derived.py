"""Keys left `null` that follow from something else, filled in once, before any check or estimate reads them.

A user who sets one of these keys gets exactly that value; `null` (the default) means:

| key | null means |
| --- | --- |
| `model.vocab_size` | the data's `vocab_size`, padded up to a multiple of 64 (fast tensor-core tiles) |
| `data.tokenizer` | the tokenizer the data records (the shards': its `tokenizer.json` lies beside them) |
| `optim.warmup_steps` | `min(100, trainer.max_steps // 10)` |
| `trainer.val_check_interval` | every `min(200, ceil(trainer.max_steps / 5))` optimizer steps, in micro-batches |

The data's facts come from the DataModule that `data:` names, through its `DataSource` members
(data/source.py), never from its config keys: any data source fills them. So `prepare` then
`train.py data.dir=...` needs no other key, and a 50-step run warms up and validates like a long one,
scaled. An explicit value that contradicts the data is refused by the DataModule, naming the shard.
"""

from __future__ import annotations

import math
from typing import Any

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig, MissingMandatoryValue, OmegaConf

from steadylm.config import set_key, validate_values
from steadylm.data.source import missing_members
from steadylm.errors import ConfigError, SteadyError, one_line

VOCAB_MULTIPLE = 64
MAX_WARMUP, WARMUP_FRACTION = 100, 10  # at most 100 steps, at most a tenth of the run
MAX_VAL_EVERY, MIN_VALIDATIONS = 200, 5  # every 200 steps at most, at least 5 times a run


def padded_vocab(vocab_size: int) -> int:
    """The smallest multiple of 64 that holds `vocab_size` ids."""
    return -(-int(vocab_size) // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def warmup_steps(max_steps: int) -> int:
    return min(MAX_WARMUP, int(max_steps) // WARMUP_FRACTION)


def val_every_steps(max_steps: int) -> int:
    return max(1, min(MAX_VAL_EVERY, math.ceil(int(max_steps) / MIN_VALIDATIONS)))


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
    missing = missing_members(dm)
    if missing:
        raise ConfigError(
            f"data._target_={cfg.data.get('_target_')} lacks {', '.join(missing)}: a data source needs the members "
            "of steadylm.data.source.DataSource (src/steadylm/data/source.py)"
        )
    dm.setup("fit")  # the source's own checks, before anything else is built
    return dm


def _freeze_interpolations(cfg: DictConfig, key: str) -> None:
    """Data keys that interpolate `key` keep the value they had while it was null (the default data.dir's
    name follows data.tokenizer: filling the tokenizer must not move the folder just read)."""
    for name, raw in OmegaConf.to_container(cfg.data, resolve=False).items():
        if isinstance(raw, str) and f"{{{key}}}" in raw:
            set_key(cfg, f"data.{name}", cfg.data[name])


def fill_derived(cfg: DictConfig) -> None:
    """Set the null keys of the table above but the last (idempotent: a filled key is an explicit one)."""
    if cfg.model.get("vocab_size") is None:  # asks the DataModule (a null tokenizer alone: it takes any)
        _freeze_interpolations(cfg, "data.tokenizer")
        dm = data_source(cfg)
        set_key(cfg, "model.vocab_size", padded_vocab(dm.vocab_size))
        if cfg.data.get("tokenizer") is None:
            set_key(cfg, "data.tokenizer", dm.tokenizer_name)
    max_steps = cfg.trainer.max_steps
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or max_steps < 1:
        return  # validate_config names the bad value
    if cfg.optim.get("warmup_steps") is None:
        set_key(cfg, "optim.warmup_steps", warmup_steps(max_steps))


def fill_val_interval(cfg: DictConfig) -> None:
    """`trainer.val_check_interval` (Lightning counts micro-batches), once `accumulate_grad_batches` is final."""
    if cfg.trainer.get("val_check_interval") is None:
        accumulate = int(cfg.trainer.get("accumulate_grad_batches") or 1)
        set_key(cfg, "trainer.val_check_interval", val_every_steps(cfg.trainer.max_steps) * accumulate)
