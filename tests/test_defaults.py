"""One set of defaults: an object built from Python with no arguments is the one `python train.py` builds.

For every steadylm `_target_` under conf/ (the stability suite's parts included) each key's value in the composed
config (the default run, and each data and callbacks option) equals the signature's default, and the default model
preset equals `GPTConfig()`. A key the code has no default for (a folder, a required name) is the config's alone.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from steadylm.config import compose
from steadylm.model.config import GPTConfig
from steadylm.stability.recovery import Recovery
from steadylm.stability.step import CHECKS, Stability

CONF = Path(__file__).resolve().parents[1] / "src" / "steadylm" / "conf"
UNSET = object()


def _class(target: str):
    module, _, name = target.replace(":", ".").rpartition(".")
    return getattr(importlib.import_module(module), name)


def _defaults(cls) -> dict:
    params = inspect.signature(cls).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _value(node: DictConfig, key: str):
    """The key's value in the composed run; UNSET where only a run can say (`???`, Hydra's runtime resolvers)."""
    try:
        value = node[key]
    except OmegaConfBaseException:
        return UNSET
    if isinstance(value, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(value, resolve=True)
        except OmegaConfBaseException:
            return UNSET
    return value


def _same(default, value) -> bool:
    empty = (None, (), [], {})  # "none", however a signature spells it (no mutable default)
    if default in empty and value in empty:
        return True
    return (list(default) if isinstance(default, tuple) else dict(default) if default == {} else default) == value


def _compare(where: str, node: DictConfig, cls, out: list) -> None:
    defaults = _defaults(cls)
    for key in node:
        if str(key).startswith("_"):
            continue
        if cls is Stability and (key == "recovery" or key in CHECKS) and node[key] is not None:
            _compare(f"{where}.{key}", node[key], Recovery if key == "recovery" else _class(CHECKS[key]), out)
            continue
        value = _value(node, key)
        if key in defaults and value is not UNSET and not _same(defaults[key], value):
            out.append(f"{where}.{key}: {defaults[key]!r} in code, {value!r} in conf/")


def _targets(node, where: str, out: list) -> None:
    if isinstance(node, DictConfig):
        target = node.get("_target_") if "_target_" in node else None
        if isinstance(target, str) and target.startswith("steadylm."):
            _compare(where, node, _class(target), out)
        for key in node:
            if OmegaConf.is_missing(node, key) or OmegaConf.is_interpolation(node, key):
                continue
            if isinstance(node[key], (DictConfig, ListConfig)):
                _targets(node[key], f"{where}.{key}" if where else str(key), out)
    elif isinstance(node, ListConfig):
        for i, item in enumerate(node):
            _targets(item, f"{where}[{i}]", out)


OPTIONS = [[]] + [
    [f"{group}={p.stem}"] for group in ("data", "callbacks") for p in sorted((CONF / group).glob("*.yaml"))
]


@pytest.mark.parametrize("overrides", OPTIONS, ids=lambda o: o[0] if o else "default")
def test_every_target_in_conf_defaults_to_what_train_py_passes_it(overrides):
    cfg = compose(overrides)
    found: list[str] = []
    _targets(cfg, "", found)
    assert found == [], "\n".join(found)


def test_the_suite_built_with_no_arguments_is_the_one_train_py_builds():
    from hydra.utils import instantiate

    built = instantiate(compose([]).callbacks.stability)
    bare = Stability()
    assert [c.name for c in bare.checks] == [c.name for c in built.checks]
    for mine, theirs in zip([*bare.checks, bare.recovery], [*built.checks, built.recovery]):
        assert mine.state_dict() == theirs.state_dict(), mine.name
        same = {k: v for k, v in vars(mine).items() if isinstance(v, (int, float, str, bool, type(None)))}
        assert same == {k: vars(theirs)[k] for k in same}, type(mine).__name__


def test_the_default_model_preset_is_gptconfig_with_no_arguments():
    preset = OmegaConf.to_container(compose([]).model, resolve=True)
    preset["vocab_size"] = preset["vocab_size"] or GPTConfig().vocab_size  # null: the data's (bytes: 320)
    built, bare = dataclasses.asdict(GPTConfig(**preset)), dataclasses.asdict(GPTConfig())
    differ = {k: (bare[k], built[k]) for k in built if built[k] != bare[k]}
    assert not differ, differ
