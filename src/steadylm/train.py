"""`train(cfg) -> (metrics, objects)`: build everything from the composed config and fit.

Tests call `train` directly with a composed config; `main` is the thin `@hydra.main` wrapper that
turns a user's mistake (`SteadyError`) into one message and a non-zero exit.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import hydra
import lightning as L
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig

from steadylm.config import CONF_DIR, plain_config, validate_config
from steadylm.errors import SteadyError
from steadylm.module import LMModule

log = logging.getLogger("steadylm")


def resolve_precision(precision: Any) -> Any:
    """`auto`: bf16-mixed where the GPU supports it, else full fp32 (CPU autocast is opt-in)."""
    if precision != "auto":
        return precision
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        return "bf16-mixed"
    return "32-true"


def instantiate_named(group: DictConfig | None) -> list[Any]:
    """Callbacks/loggers are named dict entries so `~callbacks.x` drops one; null entries are skipped."""
    if not group:
        return []
    return [instantiate(node) for node in group.values() if node is not None and "_target_" in node]


def build(cfg: DictConfig) -> dict[str, Any]:
    validate_config(cfg)
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    datamodule.setup("fit")  # shard checks run here, before any process group or logger exists
    module = LMModule(
        model=cfg.model,
        optim=cfg.optim,
        compile=cfg.compile,
        run_config=plain_config(cfg),
        tokenizer=datamodule.tokenizer_name,
    )
    trainer = instantiate(
        cfg.trainer,
        callbacks=instantiate_named(cfg.get("callbacks")),
        logger=instantiate_named(cfg.get("logger")) or False,
        precision=resolve_precision(cfg.trainer.precision),
    )
    return {"cfg": cfg, "datamodule": datamodule, "module": module, "trainer": trainer}


def train(cfg: DictConfig) -> tuple[dict[str, float], dict[str, Any]]:
    objects = build(cfg)
    trainer = objects["trainer"]
    trainer.fit(objects["module"], datamodule=objects["datamodule"], ckpt_path=cfg.get("ckpt_path"))
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    return metrics, objects


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")
def main(cfg: DictConfig) -> float | None:
    try:
        metrics, _ = train(cfg)
    except SteadyError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    metric = cfg.get("optimized_metric")
    return metrics.get(metric) if metric else None


if __name__ == "__main__":
    main()
