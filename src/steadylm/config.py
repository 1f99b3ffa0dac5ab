"""Where the Hydra config lives, how to compose it outside `@hydra.main`, and the startup refusals that need
nothing but the config (those that need the data live in the DataModule).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from steadylm.compat import config_child
from steadylm.devices import ACCELERATORS, ALLOWED_DEVICES, parse_devices
from steadylm.errors import ConfigError

# `${mul:${optim.lr},0.1}`: a value that follows another (min_lr stays 10 % of a swept lr).
OmegaConf.register_new_resolver("mul", lambda a, b: a * b, replace=True)
# `${if_null:${data.tokenizer},bytes}`: a null key's stand-in inside another value (the default data.dir).
OmegaConf.register_new_resolver("if_null", lambda value, default: default if value is None else value, replace=True)

# Inside the package, so an installed copy composes the same configs outside the repo (`conf/` at the top of
# the repo is a link to it). STEADYLM_CONF points every command at another config folder.
CONF_DIR = Path(os.environ.get("STEADYLM_CONF", Path(__file__).resolve().parent / "conf"))


def compose(overrides: list[str] | None = None, config_name: str = "train") -> DictConfig:
    """Compose the real config as `train.py` would (for tests, doctor and notebooks)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=overrides or [], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


def _leaves(node: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(node, (DictConfig, ListConfig)):
        for key in node.keys() if isinstance(node, DictConfig) else range(len(node)):
            if key != "hydra":
                yield from _leaves(config_child(node, key), f"{prefix}{key}.")
    else:
        yield prefix[:-1]


def context_length_copies(cfg: DictConfig) -> list[tuple[str, int]]:
    """Every key named `context_length` outside `model`, with its resolved value."""
    keys = [k for k in _leaves(cfg) if k.rsplit(".", 1)[-1] == "context_length" and k != "model.context_length"]
    return [(k, OmegaConf.select(cfg, k)) for k in keys]


PRECISIONS = ("auto", "32-true", "32", "64-true", "64", "bf16-mixed", "bf16-true", "bf16", "16-mixed", "16-true", "16")
OPTIMIZERS = ("adamw", "muon")


def _value_rules(cfg: DictConfig) -> list[tuple[str, Any, bool, str]]:
    """(key, value, ok, what is allowed) for every value a user sets that could not train."""
    d, t, o = cfg.data, cfg.trainer, cfg.optim
    betas = list(o.betas) if OmegaConf.is_list(o.betas) else o.betas
    betas_ok = isinstance(betas, list) and len(betas) == 2 and all(0 <= _num(b) < 1 for b in betas)
    clip, algorithm = t.get("gradient_clip_val"), t.get("gradient_clip_algorithm")
    accumulate = t.accumulate_grad_batches
    val_fraction, fused, name = d.get("val_fraction", 0.01), o.get("fused", "auto"), o.get("name", "adamw")
    rules = [
        ("data.batch_size", d.batch_size, _whole(d.batch_size, 1), "a whole number > 0"),
        ("data.num_workers", d.num_workers, _whole(d.num_workers, 0), "a whole number >= 0"),
        ("data.val_fraction", val_fraction, 0 < _num(val_fraction) <= 0.5, "a fraction in (0, 0.5]"),
        ("trainer.precision", t.precision, str(t.precision) in PRECISIONS, f"one of {', '.join(PRECISIONS)}"),
        ("trainer.accelerator", t.accelerator, str(t.accelerator) in ACCELERATORS, f"one of {', '.join(ACCELERATORS)}"),
        ("trainer.max_steps", t.max_steps, _whole(t.max_steps, 1), "a whole number of optimizer steps > 0"),
        ("trainer.accumulate_grad_batches", accumulate, _whole(accumulate, 1), "a whole number >= 1"),
        ("trainer.log_every_n_steps", t.log_every_n_steps, _whole(t.log_every_n_steps, 1), "a whole number >= 1"),
        ("trainer.gradient_clip_val", clip, _num(clip or 0) >= 0, "a norm >= 0 (1.0 is the default; 0 or null: off)"),
        ("trainer.gradient_clip_algorithm", algorithm, algorithm in ("norm", "value", None), "norm or value"),
        ("trainer.devices", t.devices, parse_devices(t.devices) is not None, ALLOWED_DEVICES),
        ("optim.lr", o.lr, _num(o.lr) > 0, "a learning rate > 0"),
        ("optim.min_lr", o.min_lr, 0 <= _num(o.min_lr) <= _num(o.lr), f"between 0 and optim.lr={o.lr}"),
        ("optim.weight_decay", o.weight_decay, _num(o.weight_decay) >= 0, "a number >= 0"),
        ("optim.eps", o.eps, _num(o.eps) > 0, "a number > 0, e.g. 1e-8"),
        ("optim.betas", betas, betas_ok, "two numbers in [0, 1), e.g. [0.9, 0.95]"),
        (
            "optim.warmup_steps",
            o.warmup_steps,
            _int(o.warmup_steps) and 0 <= o.warmup_steps < _num(o.total_steps),
            f"a whole number >= 0 and < optim.total_steps={o.total_steps} (lower it or raise trainer.max_steps)",
        ),
        ("optim.fused", fused, fused in ("auto", True, False), "auto, true or false"),
        ("optim.name", name, name in OPTIMIZERS, " or ".join(OPTIMIZERS)),
    ]
    if name == "muon" and o.get("muon") is None:
        rules.append(
            ("optim.name", "muon", False, "chosen with the group, optim=muon (it brings the optim.muon.* keys)")
        )
    elif name == "muon":
        rules += _muon_rules(o.muon, t)
    return rules


def _muon_rules(m: DictConfig, t: DictConfig) -> list[tuple[str, Any, bool, str]]:
    from steadylm.muon import ADJUST_LR, NS_COEFFS, NS_DTYPES

    strategy = t.get("strategy")
    target = str(strategy.get("_target_", "")) if isinstance(strategy, DictConfig) else str(strategy)
    return [
        ("optim.muon.lr_mult", m.lr_mult, _num(m.lr_mult) > 0, "a number > 0"),
        ("optim.muon.adjust_lr", m.adjust_lr, m.adjust_lr in ADJUST_LR, " | ".join(ADJUST_LR)),
        ("optim.muon.momentum", m.momentum, 0 <= _num(m.momentum) < 1, "a number in [0, 1), e.g. 0.95"),
        ("optim.muon.nesterov", m.nesterov, isinstance(m.nesterov, bool), "true or false"),
        ("optim.muon.ns_steps", m.ns_steps, _int(m.ns_steps) and 1 <= m.ns_steps <= 20, "a whole number in 1..20"),
        ("optim.muon.ns_dtype", m.ns_dtype, m.ns_dtype in NS_DTYPES, " | ".join(NS_DTYPES)),
        ("optim.muon.ns_coeffs", m.ns_coeffs, m.ns_coeffs in NS_COEFFS, " | ".join(NS_COEFFS)),
        (
            "trainer.strategy",
            target,
            "fsdp" not in target.lower(),
            "a strategy other than FSDP under optim=muon (Newton-Schulz needs whole matrices, FSDP shards them): "
            "use DDP, or optim=adamw",
        ),
    ]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _whole(v: Any, least: int) -> bool:
    return _int(v) and v >= least


def _num(v: Any) -> float:
    """The value as a float, or NaN (which fails every comparison) when it is not a number."""
    return float(v) if _int(v) or isinstance(v, float) else float("nan")


def validate_values(cfg: DictConfig, prefix: str = "") -> None:
    """The value rules of the keys under `prefix` (`data.` alone first: its rule's line, not the DataModule's)."""
    for key, value, ok, allowed in _value_rules(cfg):
        if key.startswith(prefix) and not ok:
            raise ConfigError(f"{key}={value!r} is not allowed; it must be {allowed}")


def validate_config(cfg: DictConfig) -> None:
    """ConfigError for a config that would train wrongly: one sentence naming the key, the value, what is allowed."""
    ctx = cfg.model.context_length
    for key, value in context_length_copies(cfg):
        if value != ctx:
            raise ConfigError(
                f"{key}={value} differs from model.context_length={ctx}: the data would feed {value}-token "
                f"windows to a {ctx}-position model. Set the context length only with model.context_length "
                f"(and leave {key} as the interpolation ${{model.context_length}})."
            )
    from steadylm.model import GPTConfig  # the model's own rules: sizes > 0, heads divide the width, switches

    GPTConfig(**OmegaConf.to_container(cfg.model, resolve=True))
    validate_values(cfg)
    from steadylm.schedule import Schedule  # the schedule's own rules: its name, wsd's decay after the warmup

    Schedule.from_optim(cfg.optim)


def plain_config(cfg: DictConfig) -> dict:
    """The resolved run config as plain containers (safe for `weights_only` checkpoints), minus `hydra`."""
    plain = {k: cfg[k] for k in cfg.keys() if k != "hydra"}
    return {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in plain.items()}


def set_key(cfg: DictConfig, key: str, value: Any) -> None:
    """Set a (possibly new) dotted key on a struct config."""
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, merge=False)
