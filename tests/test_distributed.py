"""Hydra + multi-process strategies: presets, one run dir and one writer (a sweep's jobs on 2 processes:
test_jobs.py)."""

import os
from pathlib import Path

import lightning as L
import pytest

from steadylm.progress import ProgressLines
from steadylm.train import build
from tests.helpers import CLI_TINY, run_cli


class RankProbe(L.Callback):
    """Each rank drops `rank<k>.txt` into the run dir it was given (used by the DDP test through the CLI)."""

    def on_fit_start(self, trainer, pl_module):
        Path(trainer.default_root_dir, f"rank{trainer.global_rank}.txt").write_text(str(os.getpid()))


@pytest.mark.parametrize(
    "preset,accelerator,devices,strategy",
    [("ddp_sim", "cpu", 2, "ddp"), ("ddp", "gpu", "auto", "ddp"), ("gpu", "gpu", 1, "auto"), ("cpu", "cpu", 1, "auto")],
)
def test_trainer_presets(make_cfg, preset, accelerator, devices, strategy):
    t = make_cfg(f"trainer={preset}").trainer
    assert (t.accelerator, t.devices, t.strategy) == (accelerator, devices, strategy)


def test_devices_nodes_precision_pass_straight_through(make_cfg):
    t = make_cfg("trainer=fsdp", "trainer.num_nodes=2", "trainer.devices=8", "trainer.precision=bf16-mixed").trainer
    assert (t.num_nodes, t.devices, t.precision) == (2, 8, "bf16-mixed")
    assert t.strategy._target_ == "steadylm.distributed.FSDP2Strategy"
    sim = make_cfg("trainer=fsdp_sim").trainer
    assert (sim.accelerator, sim.devices, sim.strategy.process_group_backend) == ("cpu", 2, "gloo")


def test_progress_is_plain_lines_not_a_bar(make_cfg):
    trainer = build(make_cfg("trainer.enable_progress_bar=true", "trainer.log_every_n_steps=7"))["trainer"]
    assert type(trainer.progress_bar_callback) is ProgressLines  # plain lines in SLURM logs and train.log
    assert build(make_cfg("trainer.enable_progress_bar=false"))["trainer"].progress_bar_callback is None


@pytest.mark.slow
def test_two_process_ddp_shares_rank0_run_dir_and_writes_once(shards_dir, tmp_path):
    proc = run_cli(
        "trainer=ddp_sim",
        f"data.dir={shards_dir}",
        "+callbacks.probe._target_=test_distributed.RankProbe",
        "callbacks.checkpoint.every_n_train_steps=3",
        *CLI_TINY,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "logs" / "train" / "runs").iterdir())
    assert len(runs) == 1  # the child got rank 0's ${now}-stamped dir, not its own
    run = runs[0]
    assert sorted(p.name for p in run.glob("rank*.txt")) == ["rank0.txt", "rank1.txt"]
    assert len(list(run.rglob("events.out.tfevents.*"))) == 1
    assert len(list(run.rglob(".hydra"))) == 1 and len(list(run.rglob("*.log"))) == 1  # train.log, rank 0's
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["last.ckpt", "step0000006.ckpt"]
    assert len(list(run.glob("result.json"))) == 1
