"""Crash safety: an interrupted save never corrupts the last good checkpoint, an exception saves one,
and after `kill -9` mid-run `resume=auto` in the same run dir continues from the newest good file."""

from __future__ import annotations

import hashlib
import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from steadylm import checkpointing
from steadylm.checkpointing import is_complete, safe_load
from steadylm.train import train
from tests.helpers import crash_training_at

ROOT = Path(__file__).resolve().parents[1]
EVERY4 = ["trainer.max_steps=8", "optim.warmup_steps=2", "callbacks.checkpoint.every_n_train_steps=4"]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_save_interrupted_mid_write_keeps_previous_checkpoint(make_cfg, tmp_path, monkeypatch):
    """Saves 1-2 (step 4) succeed; save 3 (step 8) dies after writing half its bytes, like a full disk."""
    ckpts = tmp_path / "run" / "checkpoints"
    real_save, calls, before = torch.save, [], {}

    def dies_half_way(obj, f, *args, **kwargs):
        if not f.name.endswith(".tmp"):  # a snapshot file (`recovery.store: disk` saves with torch.save too)
            return real_save(obj, f, *args, **kwargs)
        calls.append(1)
        if len(calls) <= 2:
            return real_save(obj, f, *args, **kwargs)
        if not before:  # the files as they were when the failing save began
            before.update({p.name: digest(p) for p in ckpts.iterdir() if p.suffix == ".ckpt"})
        buf = io.BytesIO()
        real_save(obj, buf)
        f.write(buf.getvalue()[: len(buf.getvalue()) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointing.torch, "save", dies_half_way)
    with pytest.raises(OSError, match="No space left"):
        train(make_cfg(*EVERY4))
    monkeypatch.undo()

    assert sorted(before) == ["last.ckpt", "step0000004.ckpt"]
    assert sorted(p.name for p in ckpts.iterdir()) == sorted(before)  # no partial file, not even a temp one
    assert {p.name: digest(p) for p in ckpts.iterdir()} == before  # byte-identical
    assert safe_load(ckpts / "last.ckpt")["global_step"] == 4

    _, objects = train(make_cfg(*EVERY4, "resume=auto"))
    assert objects["trainer"].global_step == 8
    assert safe_load(ckpts / "last.ckpt")["global_step"] == 8


def test_exception_in_training_saves_a_checkpoint_resume_auto_uses(make_cfg, tmp_path, monkeypatch):
    crash_training_at(monkeypatch, 6)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(make_cfg(*EVERY4))
    monkeypatch.undo()
    saved = tmp_path / "run" / "checkpoints" / "exception.ckpt"
    state = safe_load(saved)
    assert state["global_step"] == 6 and state["ShardDataModule"]["train_sampler"]["batches_done"] == 6

    _, objects = train(make_cfg(*EVERY4, "resume=auto"))
    assert objects["trainer"].global_step == 8
    shape = {"global_batch": 8, "step_batches": 1}
    assert objects["datamodule"].state_dict()["train_sampler"] == {"epoch": 0, "batches_done": 8, **shape}


def _cli(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), *args]


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_auto_finishes(shards_dir, tmp_path):
    run = tmp_path / "run"
    args = [
        "trainer=cpu",
        "model.n_layer=1",
        "model.d_model=32",
        "model.n_head=2",
        "model.context_length=32",
        "data.batch_size=4",
        "trainer.max_steps=300",
        "optim.warmup_steps=5",
        "trainer.val_check_interval=50",
        "data.val_windows=8",
        "trainer.log_every_n_steps=5",
        "trainer.enable_progress_bar=false",
        "callbacks.checkpoint.every_n_train_steps=10",
        f"data.dir={shards_dir}",
        f"hydra.run.dir={run}",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "STEADYLM_ROOT": str(tmp_path)}
    proc = subprocess.Popen(_cli(*args), cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not (run / "checkpoints" / "last.ckpt").exists():
        assert proc.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within 180 s"
        time.sleep(0.05)
    time.sleep(0.3)
    assert proc.poll() is None, "the run finished before it could be killed; raise trainer.max_steps"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    ckpts = sorted((run / "checkpoints").glob("*.ckpt"))
    assert ckpts and all(is_complete(p) for p in ckpts)  # a kill mid-save leaves only a hidden .tmp
    killed_at = max(safe_load(p)["global_step"] for p in ckpts)
    assert 10 <= killed_at < 300

    done = subprocess.run(
        _cli(*args, "resume=auto"), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resume=auto: continuing from" in done.stdout + done.stderr
    assert "dataloader is not resumable" not in done.stderr  # it is, through the datamodule's state
    final = safe_load(run / "checkpoints" / "last.ckpt")
    assert final["global_step"] == 300
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one TensorBoard run, appended
