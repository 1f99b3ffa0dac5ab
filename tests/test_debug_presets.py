"""`debug=fdr|overfit|profiler|limit|anomaly`: compose, keep runs out of logs/train, and do their job."""

import pytest

from steadylm.config import CONF_DIR
from steadylm.train import train
from tests.helpers import scalars

DEBUG = sorted(p.stem for p in (CONF_DIR / "debug").glob("*.yaml") if p.stem != "default")


@pytest.mark.parametrize("name", DEBUG)
def test_debug_preset_composes_into_the_debug_task(make_cfg, name):
    cfg = make_cfg(f"debug={name}")
    assert cfg.task_name == "debug"  # hydra.run.dir -> logs/debug/..., never among real runs
    assert "logs/debug/" in cfg.hydra.run.dir and cfg.data.num_workers == 0


def test_fdr_runs_one_batch_and_logs_nothing(make_cfg, tmp_path):
    _, objects = train(make_cfg("debug=fdr"))
    assert objects["trainer"].global_step == 1
    assert not list((tmp_path / "run").rglob("events.out.tfevents.*"))


def test_overfit_drives_the_loss_of_one_batch_down(make_cfg, tmp_path):
    # The tiny fixture's own val_check_interval would override the preset's; restate it.
    train(make_cfg("debug=overfit", "trainer.max_steps=120", "trainer.val_check_interval=1.0"))
    losses = scalars(tmp_path / "run")["train/loss"]
    assert losses[-1] < 0.5 * losses[0], losses


def test_profiler_times_every_training_batch(make_cfg):
    cfg = make_cfg("debug=profiler", "trainer.max_steps=5", "trainer.val_check_interval=5", "optim.warmup_steps=1")
    _, objects = train(cfg)
    durations = objects["trainer"].profiler.recorded_durations
    assert len(durations["run_training_batch"]) == 5
