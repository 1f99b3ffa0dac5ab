"""`data.global_batch_tokens`: tokens per optimizer step, what a recipe is written in; `accumulation` turns it into
`trainer.accumulate_grad_batches` for this many devices, so a recipe trains the same on 1 GPU or 64. It never
rounds and never overrides silently: an inexact total or a hand-set accumulation that disagrees is refused.
"""

from __future__ import annotations

import logging

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from steadylm.errors import ConfigError

log = logging.getLogger("steadylm")
KEY = "trainer.accumulate_grad_batches"


def _set_on_command_line(key: str) -> bool:
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []  # [] for a config by hand
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def accumulation(cfg: DictConfig, world_size: int) -> int:
    """global_batch_tokens / (world_size × batch × context), or the config's accumulation when that is null."""
    total, current = cfg.data.get("global_batch_tokens"), cfg.trainer.get("accumulate_grad_batches", 1)
    if total is None:
        return current
    B, T = int(cfg.data.batch_size), int(cfg.model.context_length)
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
            "or a data.batch_size that divides it"
        )
    accum = total // micro
    if current != accum and (current != 1 or _set_on_command_line(KEY)):
        raise ConfigError(
            f"{KEY}={current} contradicts data.global_batch_tokens={total}, which needs {accum} "
            f"({total:,} / {shown}); set only one of them"
        )
    log.info("data.global_batch_tokens=%s: %s=%d (%s per micro-step)", f"{total:,}", KEY, accum, shown)
    return accum
