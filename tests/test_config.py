"""Config composition and the startup refusals that need only the config."""

import pytest
from hydra.utils import instantiate

from steadylm.config import CONF_DIR, compose, validate_config
from steadylm.errors import ConfigError
from steadylm.train import build


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group,option",
    [
        (g, o)
        for g in ("model", "data", "optim", "trainer", "callbacks", "logger", "paths", "hydra")
        for o in group_options(g)
    ],
)
def test_every_config_option_composes_and_resolves(group, option, tmp_path):
    cfg = compose([f"{group}={option}", f"paths.output_dir={tmp_path}"])
    assert cfg.model.context_length == cfg.data.context_length
    for key in ("model", "data", "optim", "trainer", "callbacks", "logger"):
        cfg[key]  # resolves interpolations


def test_presets_have_documented_shapes():
    small = compose(["model=small", "paths.output_dir=/tmp/x"]).model
    assert (small.n_layer, small.n_head, small.d_model, small.context_length, small.vocab_size) == (
        12,
        12,
        768,
        1024,
        50304,
    )
    import torch

    from steadylm.model import GPT, GPTConfig

    with torch.device("meta"):
        n = GPT(GPTConfig(**small)).num_params(non_embedding=False)
    assert 123e6 < n < 126e6  # GPT-2 small


def test_four_gpu_command_composes_to_ddp(tmp_path):
    cfg = compose(["model=small", "trainer.devices=4", f"paths.output_dir={tmp_path}"])
    assert cfg.trainer.devices == 4 and cfg.trainer.gradient_clip_val == 1.0


def test_context_length_copy_that_differs_is_refused_naming_both_keys(tmp_path):
    """The original repo's bug: 16-token data windows for a 512-position model."""
    cfg = compose(["model.context_length=512", "data.context_length=16", f"paths.output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as err:
        validate_config(cfg)
    assert "data.context_length=16" in str(err.value) and "model.context_length=512" in str(err.value)


def test_a_new_copy_anywhere_in_the_tree_is_checked(tmp_path):
    cfg = compose(["+callbacks.extra.context_length=64", f"paths.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match="callbacks.extra.context_length=64"):
        validate_config(cfg)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (["optim.min_lr=1.0", "optim.lr=0.1"], "optim.min_lr"),
        (["optim.warmup_steps=5000"], "optim.warmup_steps"),
    ],
)
def test_schedule_refusals(overrides, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        validate_config(compose([*overrides, "model.vocab_size=320", f"paths.output_dir={tmp_path}"]))


def test_callbacks_and_loggers_are_named_and_droppable(tmp_path):
    cfg = compose(["~callbacks.throughput", f"paths.output_dir={tmp_path}"])
    assert "throughput" not in cfg.callbacks and "checkpoint" in cfg.callbacks
    cfg = compose(["logger=none", f"paths.output_dir={tmp_path}"])
    assert not cfg.get("logger")


def test_gradient_clipping_is_on_by_default(tmp_path):
    trainer = instantiate(compose([f"paths.output_dir={tmp_path}", "trainer=cpu"]).trainer, precision="32-true")
    assert trainer.gradient_clip_val == 1.0 and trainer.gradient_clip_algorithm == "norm"


def test_shards_with_a_larger_vocab_than_the_model_are_refused(make_cfg, shards_dir):
    with pytest.raises(Exception) as err:
        build(make_cfg("model.vocab_size=128"))
    assert "model.vocab_size" in str(err.value) and "train-00000.h5" in str(err.value)
