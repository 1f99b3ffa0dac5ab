"""The config is resolved once (resolve.py): every filled value in the config before anything is built, the
DataModule built once and reused, and a config no later pass can change."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ReadonlyConfigError

from steadylm.config import compose, plain_config, set_key
from steadylm.data.datamodule import ShardDataModule
from steadylm.devices import AUTO_PRECISION_ENV, Devices
from steadylm.errors import ConfigError
from steadylm.resolve import resolve
from tests.conftest import TINY_OVERRIDES
from tests.helpers import fit


class CountedShards(ShardDataModule):
    """The shard DataModule, counting how many are built."""

    built = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        CountedShards.built += 1


@pytest.fixture
def null_cfg(shards_dir, tmp_path):
    """The tiny test config with every derived key left null, as a user's default config leaves it."""

    def _make(*overrides: str):
        nulls = ["optim.warmup_steps=null", "trainer.val_check_interval=null"]
        return compose([*TINY_OVERRIDES, f"data.dir={shards_dir}", f"paths.output_dir={tmp_path}", *nulls, *overrides])

    return _make


def test_a_fit_runs_on_the_read_only_config_with_the_filled_values(null_cfg):
    # 1024 tokens a step / (1 device x 8 x 64) = 2 micro-batches; 10 steps: warmup 10 // 10 = 1,
    # validation every ceil(10 / 5) = 2 optimizer steps, which Lightning counts as 4 micro-batches.
    cfg = null_cfg("trainer.max_steps=10", "data.global_batch_tokens=1024", f"data._target_={__name__}.CountedShards")
    assert cfg.model.vocab_size is None and cfg.data.tokenizer is None
    CountedShards.built = 0
    objs = fit(cfg)
    assert CountedShards.built == 1  # the DataModule that gave the vocabulary is the one trained on
    assert OmegaConf.is_readonly(cfg)
    filled = (
        cfg.model.vocab_size,
        cfg.data.tokenizer,
        cfg.optim.warmup_steps,
        cfg.trainer.accumulate_grad_batches,
        cfg.trainer.val_check_interval,
    )
    assert filled == (320, "bytes", 1, 2, 2)
    trainer, module = objs["trainer"], objs["module"]
    assert trainer.global_step == 10 and "val/loss" in trainer.callback_metrics
    assert (trainer.accumulate_grad_batches, trainer.val_check_interval) == (2, 4)
    assert module.net.cfg.vocab_size == 320 and module.schedule.warmup_steps == 1 and module.tokenizer_name == "bytes"
    run = module.run_config  # what every checkpoint carries
    assert (run["model"]["vocab_size"], run["data"]["model_vocab_size"], run["optim"]["warmup_steps"]) == (320, 320, 1)
    assert (run["trainer"]["accumulate_grad_batches"], run["trainer"]["val_check_interval"]) == (2, 2)


def test_no_pass_after_resolution_can_change_the_config(null_cfg):
    cfg = null_cfg("trainer.max_steps=10")
    resolve(cfg)
    with pytest.raises(ReadonlyConfigError):
        cfg.optim.lr = 1.0
    with pytest.raises(ReadonlyConfigError):
        set_key(cfg, "trainer.max_steps", 20)
    with pytest.raises(ReadonlyConfigError):
        set_key(cfg, "trainer.new_key", 1)  # a new key too, even through open_dict
    before = plain_config(cfg)
    resolve(cfg)  # a resolved config resolves again without a write
    assert plain_config(cfg) == before and cfg.optim.lr != 1.0


def test_precision_and_devices_are_resolved_beside_the_config_which_keeps_auto(null_cfg, monkeypatch):
    monkeypatch.setenv(AUTO_PRECISION_ENV, "32-true")  # `auto` as a CPU without bf16 units resolves it
    run = resolve(null_cfg("trainer.precision=auto"))
    assert (run.precision, run.devices) == ("32-true", Devices("cpu", 1, 1))
    assert run.cfg.trainer.precision == "auto" and run.cfg.trainer.devices == 1
    assert run.memory.fits and run.memory.processes == 1


def test_a_set_vocabulary_checks_the_config_before_the_data_is_read(null_cfg, tmp_path):
    cfg = null_cfg("model.vocab_size=320", f"data.dir={tmp_path / 'nowhere'}", "optim.lr=-1")
    with pytest.raises(ConfigError, match=r"^optim\.lr=-1 is not allowed; it must be a learning rate > 0$"):
        resolve(cfg)
