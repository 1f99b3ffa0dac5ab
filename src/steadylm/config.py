"""Where the Hydra config lives, how to compose it outside `@hydra.main`, and the startup refusals.

The refusals here are the ones that need nothing but the config: a second context length that
differs from `model.context_length`, a vocabulary that is not padded, a schedule that cannot run.
Checks that need the data (shard vocab, window length) live in the DataModule.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from steadylm.errors import ConfigError

CONF_DIR = Path(os.environ.get("STEADYLM_CONF", Path(__file__).resolve().parents[2] / "conf"))


def compose(overrides: list[str] | None = None, config_name: str = "train") -> DictConfig:
    """Compose the real config as `train.py` would (for tests, doctor and notebooks)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=overrides or [], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


def _leaves(node: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(node, DictConfig):
        for key in node.keys():
            if key == "hydra":
                continue
            yield from _leaves(node._get_node(key), f"{prefix}{key}.")
    elif isinstance(node, ListConfig):
        for i in range(len(node)):
            yield from _leaves(node._get_node(i), f"{prefix}{i}.")
    else:
        yield prefix[:-1], node


def context_length_copies(cfg: DictConfig) -> list[tuple[str, int]]:
    """Every key named `context_length` outside `model`, with its resolved value."""
    copies = []
    for key, node in _leaves(cfg):
        if key.split(".")[-1] == "context_length" and key != "model.context_length":
            copies.append((key, OmegaConf.select(cfg, key)))
    return copies


def validate_config(cfg: DictConfig) -> None:
    """Raise ConfigError for a config that would train wrongly; the message names keys and the fix."""
    ctx = cfg.model.context_length
    for key, value in context_length_copies(cfg):
        if value != ctx:
            raise ConfigError(
                f"{key}={value} differs from model.context_length={ctx}: the data would feed {value}-token "
                f"windows to a {ctx}-position model. Set the context length only with model.context_length "
                f"(and leave {key} as the interpolation ${{model.context_length}})."
            )
    o = cfg.optim
    if o.min_lr > o.lr:
        raise ConfigError(f"optim.min_lr={o.min_lr} > optim.lr={o.lr}; the cosine decay would go up.")
    if o.warmup_steps >= o.total_steps:
        raise ConfigError(
            f"optim.warmup_steps={o.warmup_steps} >= optim.total_steps={o.total_steps}: the LR would never decay; "
            "lower optim.warmup_steps or raise trainer.max_steps."
        )


def plain_config(cfg: DictConfig) -> dict:
    """The resolved run config as plain containers (safe for `weights_only` checkpoints), minus `hydra`."""
    return {
        key: OmegaConf.to_container(cfg[key], resolve=True) if isinstance(cfg[key], (DictConfig, ListConfig)) else cfg[key]
        for key in cfg.keys()
        if key != "hydra"
    }


def set_key(cfg: DictConfig, key: str, value: Any) -> None:
    """Set a (possibly new) dotted key on a struct config."""
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, merge=False)
