"""`data.global_batch_tokens` -> `trainer.accumulate_grad_batches`, and the reference recipes that use it."""

from __future__ import annotations

import pytest

from steadylm import derived
from steadylm.config import compose
from steadylm.errors import ConfigError


def accumulation(cfg, world: int) -> int:
    """At the shard DataModule's batch size (what `resolve` asks the DataModule for)."""
    return derived.accumulation(cfg, world, cfg.data.batch_size)


@pytest.mark.parametrize("world,accum", [(1, 32), (2, 16), (8, 4), (32, 1)])
def test_recipe_tokens_per_step_are_the_same_on_any_number_of_devices(world, accum):
    cfg = compose(["experiment=gpt2_124m"])
    assert accumulation(cfg, world) == accum
    assert accum * world * cfg.data.batch_size * cfg.model.context_length == 524_288


def test_a_total_that_is_not_whole_micro_steps_is_refused_with_the_arithmetic():
    cfg = compose(["experiment=gpt2_124m"])
    with pytest.raises(
        ConfigError,
        match=r"data\.global_batch_tokens=524288 is not a multiple of "
        r"devices×batch×context = 3×16×1024 = 49,152; use 491,520 or 540,672",
    ):
        accumulation(cfg, 3)
    with pytest.raises(ConfigError, match="must be a whole number of tokens > 0"):
        accumulation(compose(["data.global_batch_tokens=0"]), 1)


def test_an_explicit_accumulation_that_disagrees_is_refused_and_one_that_agrees_is_kept():
    with pytest.raises(
        ConfigError,
        match=r"trainer\.accumulate_grad_batches=2 contradicts data\.global_batch_tokens=524288, "
        r"which needs 32",
    ):
        accumulation(compose(["experiment=gpt2_124m", "trainer.accumulate_grad_batches=2"]), 1)
    with pytest.raises(ConfigError, match="accumulate_grad_batches=1 contradicts"):  # explicit 1 counts too
        accumulation(compose(["experiment=gpt2_124m", "trainer.accumulate_grad_batches=1"]), 1)
    assert accumulation(compose(["experiment=gpt2_124m", "trainer.accumulate_grad_batches=32"]), 1) == 32


def test_null_leaves_accumulation_alone():
    cfg = compose(["trainer.accumulate_grad_batches=3"])
    assert cfg.data.global_batch_tokens is None and accumulation(cfg, 4) == 3


def test_train_build_derives_the_accumulation(make_cfg):
    from steadylm.train import build

    objs = build(make_cfg("data.global_batch_tokens=1024", "callbacks=minimal"))  # 1024 / (1 × 8 × 64) = 2
    assert objs["trainer"].accumulate_grad_batches == 2
    assert objs["module"].run_config["trainer"]["accumulate_grad_batches"] == 2  # what every checkpoint records


@pytest.mark.parametrize("name,pos", [("gpt2_124m", "learned"), ("llama_124m", "rope")])
def test_reference_recipes_compose_with_their_stated_settings(name, pos):
    cfg = compose([f"experiment={name}"])
    m, o = cfg.model, cfg.optim
    assert (m.n_layer, m.d_model, m.context_length, m.pos) == (12, 768, 1024, pos)
    assert (o.lr, o.min_lr, o.weight_decay, list(o.betas)) == (6e-4, 6e-5, 0.1, [0.9, 0.95]) and o.warmup_steps > 0
    assert cfg.trainer.precision == "bf16-mixed" and cfg.compile is True
    assert cfg.trainer.max_steps * cfg.data.global_batch_tokens == pytest.approx(10e9, rel=0.001)
    if pos == "rope":
        assert (m.norm, m.mlp, m.bias) == ("rmsnorm", "swiglu", False)
