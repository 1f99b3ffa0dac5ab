"""The loggers users pick: each writes its files, and `diagnose` works from any of them (CSV alone included)."""

import csv
import os

import pytest

from steadylm.diagnose.runlog import load_run
from steadylm.train import train

STEPS = ("trainer.max_steps=6", "trainer.log_every_n_steps=2", "trainer.val_check_interval=3", "optim.warmup_steps=2")


def read_csv(run) -> list[dict]:
    with (run / "csv" / "metrics.csv").open() as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("logger", ["tensorboard", "csv", "many"])
def test_logger_writes_and_diagnose_reads_it(make_cfg, tmp_path, logger):
    train(make_cfg(f"logger={logger}", *STEPS))
    run = tmp_path / "run"
    has_tb = bool(list(run.rglob("events.out.tfevents.*")))
    assert has_tb == (logger in ("tensorboard", "many"))
    if logger != "tensorboard":
        rows = read_csv(run)
        assert any(r.get("train/loss") for r in rows) and any(r.get("val/loss") for r in rows)
        assert any(r.get("optim/grad_norm") for r in rows)  # the direct-to-logger metrics reach CSV too
    log = load_run(run)
    steps, losses = log.series("train/loss")
    assert len(steps) >= 3 and (losses > 0).all()
    assert len(log.series("val/loss")[0]) == 2


@pytest.mark.slow  # wandb starts its own service process (~10 s)
def test_wandb_logs_offline_with_no_network(make_cfg, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    train(make_cfg("logger=wandb", *STEPS))
    run = tmp_path / "run"
    offline = list((run / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("*.wandb")), os.listdir(run)
    assert len(load_run(run).series("train/loss")[0]) >= 3  # diagnose reads the CSV kept beside it
