"""The config is resolved once (resolve.py): every filled value in the config before anything is built, the
DataModule built once and reused, and a config no later pass can change."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from omegaconf import OmegaConf, open_dict
from omegaconf.errors import ReadonlyConfigError
from torch.utils.data import DataLoader, TensorDataset

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


class Minimal(L.LightningDataModule):
    """A forker's data source with the members of data/source.py and no other key: random windows of ids."""

    vocab_size, tokenizer_name, bytes_per_token, n_train_windows = 64, "bytes", None, None

    def __init__(self, context: int = 64, batch_size: int = 4, global_batch_tokens: int | None = None) -> None:
        super().__init__()
        self.context, self.batch_size = context, batch_size

    def _loader(self, n: int):
        ids = torch.randint(0, self.vocab_size, (n, self.context + 1), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=self.batch_size)

    def train_dataloader(self):
        return self._loader(256)

    def val_dataloader(self):
        return self._loader(8)

    def window_ids(self, batch_idx: int) -> list[int]:
        return []

    def window_location(self, window: int) -> dict:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state_dict: dict) -> None: ...

    def setup(self, stage: str | None = None) -> None: ...


def test_a_data_config_of_only_a_target_trains_and_the_batch_size_comes_from_the_source(null_cfg):
    """Startup asks the DataModule (its `batch_size` for the memory plan and `data.global_batch_tokens`), never the
    shard DataModule's keys: a data config of one `_target_` trains."""
    cfg = null_cfg("trainer.max_steps=4", "callbacks.checkpoint.every_n_train_steps=4")
    with open_dict(cfg):
        cfg.data = OmegaConf.create({"_target_": f"{__name__}.Minimal", "global_batch_tokens": 4 * 64 * 3})
    objs = fit(cfg)
    assert objs["trainer"].global_step == 4 and cfg.trainer.accumulate_grad_batches == 3  # 768 / (4 x 64)
    assert cfg.model.vocab_size == 64 and "val/loss" in objs["trainer"].callback_metrics
    assert set(cfg.data) == {"_target_", "global_batch_tokens", "tokenizer"}  # the tokenizer filled from the source


def test_a_data_source_without_a_batch_size_is_one_line_naming_it(null_cfg):
    class NoBatch(Minimal):
        def __init__(self) -> None:
            super().__init__()
            del self.batch_size

    cfg = null_cfg("trainer.max_steps=4")
    with open_dict(cfg):
        cfg.data = OmegaConf.create({"_target_": f"{__name__}.NoBatchSize"})
    globals()["NoBatchSize"] = NoBatch
    with pytest.raises(ConfigError, match=r"^data._target_=tests.test_resolve.NoBatchSize lacks batch_size: a data"):
        resolve(cfg)
