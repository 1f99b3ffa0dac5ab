"""Keys left `null` that follow from something else, filled in once, before any check or estimate reads them.

A user who sets one of these keys gets exactly that value; `null` (the default) means:

| key | null means |
| --- | --- |
| `model.vocab_size` | the shards' `vocab_size`, padded up to a multiple of 64 (fast tensor-core tiles) |
| `data.tokenizer` | the tokenizer the shards record (its `tokenizer.json` lies beside them): any is accepted |
| `optim.warmup_steps` | `min(100, trainer.max_steps // 10)` |
| `trainer.val_check_interval` | every `min(200, ceil(trainer.max_steps / 5))` optimizer steps, in micro-batches |

So `prepare` then `train.py data.dir=...` needs no other key, and a 50-step run warms up and validates like a
long one, scaled. An explicit value that contradicts the shards is refused by the DataModule, naming the shard.
"""

from __future__ import annotations

import math
from pathlib import Path

from omegaconf import DictConfig

from steadylm.config import set_key
from steadylm.data.shards import read_shard_info, shard_files

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


def fill_derived(cfg: DictConfig) -> None:
    """Set the null keys of the table above but the last (idempotent: a filled key is an explicit one)."""
    if cfg.model.get("vocab_size") is None:  # one shard read (a null tokenizer alone: the DataModule takes any)
        set_key(cfg, "data.dir", str(cfg.data.dir))  # the default folder's name follows data.tokenizer: fix it first
        info = read_shard_info(shard_files(Path(cfg.data.dir).expanduser(), "train")[0])
        set_key(cfg, "model.vocab_size", padded_vocab(info.vocab_size))
        if cfg.data.get("tokenizer") is None:
            set_key(cfg, "data.tokenizer", info.tokenizer)
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
