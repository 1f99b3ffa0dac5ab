"""Where the Hydra config lives, how to compose it outside `@hydra.main`, the startup refusals that need nothing but
the config (those that need the data live in the DataModule), and Hydra's own errors as one line."""

from __future__ import annotations

import contextlib
import difflib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf, open_dict

from steadylm.errors import ConfigError, exit_with, is_int, number
from steadylm.lr_rule import lr_rule

# `${mul:${optim.lr},0.1}`: a value that follows another (min_lr stays 10 % of a swept lr).
OmegaConf.register_new_resolver("mul", lambda a, b: a * b, replace=True)
# `${if_null:${data.tokenizer},bytes}`: a null key's stand-in inside another value (the default data.dir).
OmegaConf.register_new_resolver("if_null", lambda value, default: default if value is None else value, replace=True)


def sweep_dir(base: str, stamp: str, resume: Any) -> str:
    """`hydra.sweep.dir`: a new `<base>/<stamp>`; under `resume=auto` the newest in `base` (the same `-m` goes on)."""
    if resume == "auto" and (found := sorted(p for p in Path(base).glob("*") if p.is_dir())):
        return str(found[-1])
    return f"{base}/{stamp}"


OmegaConf.register_new_resolver("sweep_dir", sweep_dir, replace=True)


# `${lr_rule:${optim.lr_rule}}`: optim.lr follows the model's width and the tokens a step (lr_rule.py).
OmegaConf.register_new_resolver("lr_rule", lr_rule, replace=True)

# In the package, so an installed copy composes the same configs (the repo's `conf/` links here); or STEADYLM_CONF.
CONF_DIR = Path(os.environ.get("STEADYLM_CONF", Path(__file__).resolve().parent / "conf"))
PRECISIONS = ("auto", "32-true", "32", "64-true", "64", "bf16-mixed", "bf16-true", "bf16", "16-mixed", "16-true", "16")
OPTIMIZERS = ("adamw", "muon")


def compose(overrides: list[str] | None = None, config_name: str = "train") -> DictConfig:
    """Compose the real config as `train.py` would (for tests, doctor and notebooks)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=overrides or [], return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    return cfg


def context_length_copies(cfg: DictConfig) -> list[tuple[str, int]]:
    """Every key named `context_length` outside `model` and `hydra`, with its resolved value."""

    def copies(node: Any, prefix: str = "") -> Iterator[str]:
        for k, v in node.items() if isinstance(node, dict) else enumerate(node):
            if isinstance(v, (dict, list)) and k != "hydra":
                yield from copies(v, f"{prefix}{k}.")
            elif k == "context_length" and prefix != "model.":
                yield f"{prefix}{k}"

    return [(k, OmegaConf.select(cfg, k)) for k in copies(OmegaConf.to_container(cfg, resolve=False))]


_whole = lambda v, least: is_int(v) and v >= least


# Lightning's count is of batches per rank, so val/loss would move with the ranks and the micro-batch size.
LIMIT_VAL = (
    "0 (no validation) or 1.0 (every window data.val_windows allows): a count of batches is per rank, so the "
    "windows validated would change with the machine; bound validation with data.val_windows"
)


def _value_rules(cfg: DictConfig) -> list[tuple[str, Any, bool, str]]:
    """(key, value, ok, what is allowed) for every value a user sets that could not train."""
    d, t, o = cfg.data, cfg.trainer, cfg.optim
    betas = list(o.betas) if OmegaConf.is_list(o.betas) else o.betas
    betas_ok = isinstance(betas, list) and len(betas) == 2 and all(0 <= number(b) < 1 for b in betas)
    clip, algorithm = t.get("gradient_clip_val"), t.get("gradient_clip_algorithm")
    accumulate, val_fraction, align = t.accumulate_grad_batches, d.get("val_fraction", 0.01), d.get("align", "none")
    val_windows = d.get("val_windows")
    fused, name = o.get("fused", "auto"), o.get("name", "adamw")
    warmup_ok = is_int(o.warmup_steps) and 0 <= o.warmup_steps < number(o.total_steps)
    warmup = f"a whole number >= 0 and < optim.total_steps={o.total_steps} (lower it or raise trainer.max_steps)"
    data = [  # the shard DataModule's keys, where the data config has them (a custom source checks its own)
        ("data.batch_size", d.get("batch_size"), _whole(d.get("batch_size"), 1), "a whole number > 0"),
        ("data.num_workers", d.get("num_workers"), _whole(d.get("num_workers"), 0), "a whole number >= 0"),
        ("data.val_fraction", val_fraction, 0 < number(val_fraction) <= 0.5, "a fraction in (0, 0.5]"),
        ("data.align", align, align in ("none", "doc"), "none (a window every T tokens) or doc (per document)"),
        ("data.val_windows", val_windows, val_windows is None or _whole(val_windows, 1), "a whole number > 0 or null"),
    ]
    limit = t.get("limit_val_batches", 1.0)
    rules = [
        *(rule for rule in data if rule[0][len("data.") :] in d),
        ("trainer.precision", t.precision, str(t.precision) in PRECISIONS, f"one of {', '.join(PRECISIONS)}"),
        ("trainer.max_steps", t.max_steps, _whole(t.max_steps, 1), "a whole number of optimizer steps > 0"),
        ("trainer.accumulate_grad_batches", accumulate, _whole(accumulate, 1), "a whole number >= 1"),
        ("trainer.log_every_n_steps", t.log_every_n_steps, _whole(t.log_every_n_steps, 1), "a whole number >= 1"),
        ("trainer.gradient_clip_val", clip, number(clip or 0) >= 0, "a norm >= 0 (1.0 is the default; 0 or null: off)"),
        ("trainer.gradient_clip_algorithm", algorithm, algorithm in ("norm", "value", None), "norm or value"),
        ("trainer.limit_val_batches", limit, limit == 0 or (type(limit) is float and limit == 1.0), LIMIT_VAL),
        ("optim.lr", o.lr, number(o.lr) > 0, "a learning rate > 0"),
        ("optim.min_lr", o.min_lr, 0 <= number(o.min_lr) <= number(o.lr), f"between 0 and optim.lr={o.lr}"),
        ("optim.weight_decay", o.weight_decay, number(o.weight_decay) >= 0, "a number >= 0"),
        ("optim.eps", o.eps, number(o.eps) > 0, "a number > 0, e.g. 1e-8"),
        ("optim.betas", betas, betas_ok, "two numbers in [0, 1), e.g. [0.9, 0.95]"),
        ("optim.warmup_steps", o.warmup_steps, warmup_ok, warmup),
        ("optim.fused", fused, fused in ("auto", True, False), "auto, true or false"),
        ("optim.name", name, name in OPTIMIZERS, " or ".join(OPTIMIZERS)),
    ]
    if name != "muon":
        return rules
    if o.get("muon") is None:
        return [
            *rules,
            ("optim.name", name, False, "chosen with the group, optim=muon (it brings the optim.muon.* keys)"),
        ]
    from steadylm.muon import config_rules  # only optim=muon loads Muon

    return rules + config_rules(o.muon)


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
    from steadylm.schedule import Schedule  # the schedule's own rules: its name, wsd's decay after the warmup

    GPTConfig(**OmegaConf.to_container(cfg.model, resolve=True))
    validate_values(cfg)
    Schedule.from_optim(cfg.optim)


def plain_config(cfg: DictConfig) -> dict:
    """The resolved run config as plain containers (safe for `weights_only` checkpoints), minus `hydra`."""
    plain = {k: cfg[k] for k in cfg.keys() if k != "hydra"}
    return {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in plain.items()}


def set_key(cfg: DictConfig, key: str, value: Any) -> None:
    """Set a (possibly new) dotted key on a struct config."""
    with open_dict(cfg):
        OmegaConf.update(cfg, key, value, merge=False)


def hydra_error_message(err: Exception) -> str:
    """One line for an error Hydra raised while composing the config or creating the run folder."""
    if isinstance(err, MissingConfigException) and err.options:
        first = str(err).splitlines()[0].removeprefix("In 'train': ")
        return f"{first}; available: {', '.join(err.options)} (see conf/)"
    full_key, parent = getattr(err.__cause__, "full_key", None), getattr(err.__cause__, "parent_node", None)
    if isinstance(err, HydraException) and full_key:  # `trainer.max_stepz=3`: the closest real keys, and `+`
        leaf = full_key.rsplit(".", 1)[-1]
        known = [str(k) for k in parent.keys()] if isinstance(parent, DictConfig) else []
        close = difflib.get_close_matches(leaf, known, n=2)
        hint = f"did you mean {' or '.join(full_key[: -len(leaf)] + c for c in close)}? " if close else ""
        return f"{full_key} is not a config key; {hint}(to add a new key on purpose, write +{full_key}=...)"
    if isinstance(err, OSError):
        where = err.filename or "the run folder"
        return f"cannot create {where} ({err.strerror or err}); pass hydra.run.dir=<a folder you can write>"
    return " ".join(line.strip() for line in str(err).splitlines() if line.strip())


@contextlib.contextmanager
def hydra_errors_as_messages(started: list[bool]) -> Iterator[None]:
    """Hydra's composition/run-folder errors as `error: <one line>`, exit 2: they escape only under HYDRA_FULL_ERROR
    (set for the call unless the user set it); `started[0]`, set once the task runs, keeps training's errors as is."""
    if os.environ.get("HYDRA_FULL_ERROR"):
        yield
        return
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        yield
    except (HydraException, OSError) as err:
        if started[0]:
            raise
        exit_with(ConfigError(hydra_error_message(err)))
    finally:
        os.environ.pop("HYDRA_FULL_ERROR", None)
