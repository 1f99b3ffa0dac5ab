"""Null keys that follow from something else: vocabulary and tokenizer from the shards, warmup and validation from
the run length; an explicit setting wins, and one that contradicts the shards is refused naming the shard."""

from __future__ import annotations

import lightning as L
import pytest
from omegaconf import OmegaConf, open_dict

from steadylm.config import compose
from steadylm.derived import (
    data_source,
    from_data,
    from_run_length,
    padded_vocab,
    val_every_steps,
    val_interval,
    warmup_steps,
)
from steadylm.errors import ConfigError, DataError
from steadylm.resolve import fill_derived
from steadylm.train import build


def test_the_rules():
    assert [padded_vocab(v) for v in (257, 512, 2048, 50257, 128256)] == [320, 512, 2048, 50304, 128256]
    assert [warmup_steps(n) for n in (5, 10, 50, 300, 2000, 20000)] == [0, 1, 5, 30, 100, 100]
    assert [val_every_steps(n) for n in (1, 3, 10, 50, 300, 2000, 20000)] == [1, 1, 2, 10, 60, 200, 200]


def test_null_keys_come_from_the_shards_and_the_run_length(shards_dir):
    cfg = compose([f"data.dir={shards_dir}", "trainer.max_steps=50", "model.context_length=64"])
    assert cfg.model.vocab_size is None and cfg.data.tokenizer is None  # the defaults
    assert from_data(cfg, data_source(cfg)) == {"data.tokenizer": "bytes", "model.vocab_size": 320}
    assert from_run_length(cfg) == {"optim.warmup_steps": 5}
    assert val_interval(cfg) == {"trainer.val_check_interval": 10}  # optimizer steps, whatever the accumulation
    assert cfg.model.vocab_size is None and cfg.optim.warmup_steps is None  # nothing above wrote the config


def test_a_set_key_is_kept():
    assert from_data(compose(["model.vocab_size=384"]), None) == {}  # set by hand: the data is not asked
    assert from_run_length(compose(["optim.warmup_steps=3"])) == {}
    assert from_run_length(compose(["trainer.max_steps=0"])) == {}  # a bad length: validate_config names it
    assert val_interval(compose(["trainer.val_check_interval=7"])) == {}


def test_the_default_data_dir_stays_where_it_was_read(shards_dir, tmp_path):
    """data.dir's default name follows data.tokenizer: filling the tokenizer must not move the folder just read."""
    (tmp_path / "stdlib-bytes").symlink_to(shards_dir)
    cfg = compose([f"paths.data_dir={tmp_path}"])
    assert from_data(cfg, data_source(cfg))["data.dir"] == f"{tmp_path}/stdlib-bytes"


def test_explicit_settings_win_and_a_contradiction_names_the_shard(make_cfg):
    module = build(make_cfg("model.vocab_size=384", "data.tokenizer=bytes"))["module"]
    assert module.net.cfg.vocab_size == 384  # larger than the shards' is allowed: set by hand
    with pytest.raises(DataError, match=r"train-00000\.h5: shard vocab_size 257 exceeds model\.vocab_size 256"):
        build(make_cfg("model.vocab_size=256"))
    with pytest.raises(DataError, match=r"written by tokenizer 'bytes' but data\.tokenizer is 'bpe'"):
        build(make_cfg("data.tokenizer=bpe"))


def test_no_shards_and_a_null_vocab_is_one_line_naming_the_command(make_cfg, tmp_path):
    with pytest.raises(DataError, match=r"nowhere: data\.dir does not exist; run `make data` or `python -m steadylm"):
        build(make_cfg(f"data.dir={tmp_path / 'nowhere'}"))


class _ValSteps(L.Callback):
    def __init__(self):
        self.steps = []

    def on_validation_end(self, trainer, pl_module):
        self.steps.append(trainer.global_step)


def test_a_run_validates_at_its_end_whatever_the_interval(make_cfg):
    objects = build(make_cfg("trainer.max_steps=7", "trainer.val_check_interval=5", "callbacks=minimal"))
    seen = _ValSteps()
    objects["trainer"].callbacks.append(seen)
    objects["trainer"].fit(objects["module"], datamodule=objects["datamodule"])
    assert seen.steps == [5, 7] and "val/loss" in objects["trainer"].callback_metrics


class Bare(L.LightningDataModule):
    """A DataModule without the DataSource members (data/source.py)."""

    def __init__(self, batch_size: int = 8, num_workers: int = 0):
        super().__init__()


def test_a_data_module_without_the_source_members_is_refused_naming_them():
    cfg = compose(["trainer.max_steps=50"])
    with open_dict(cfg):
        cfg.data = OmegaConf.create({"_target_": f"{__name__}.Bare", "batch_size": 8, "num_workers": 0})
    with pytest.raises(
        ConfigError, match=r"Bare lacks batch_size, vocab_size, tokenizer_name, bytes_per_token, .*: a data source"
    ):
        fill_derived(cfg)


def test_a_bad_data_value_is_its_rule_before_the_data_module_is_built(shards_dir):
    with pytest.raises(ConfigError, match=r"data\.batch_size='abc' is not allowed"):
        fill_derived(compose([f"data.dir={shards_dir}", "data.batch_size=abc"]))
