"""Snapshots: what they hold, where they live, when they count as known-good, and that a rollback uses them."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import lightning as L
import pytest
import torch

from steadylm.errors import ConfigError
from steadylm.stability import read_events, snapshot_store
from steadylm.stability import recovery as recovery_module
from steadylm.stability.recovery import Recovery, capture, restore_weights_and_optimizer
from steadylm.stability.snapshot_store import HostBuffers, SnapshotFile
from tests.helpers import FAST, faults, fit, stability_of

ROOT = Path(__file__).resolve().parents[1]


def state(trainer, module):
    opt = trainer.optimizers[0]
    return (
        [p.detach().clone() for p in module.parameters()],
        [{k: v.clone() for k, v in opt.state[p].items()} for p in module.parameters()],
    )


@pytest.mark.parametrize("store", ["memory", "disk"])
def test_a_snapshot_restores_weights_and_adam_state_bitwise_and_is_never_written_by_training(make_cfg, store, tmp_path):
    objs = fit(make_cfg(*FAST))
    trainer, module = objs["trainer"], objs["module"]
    before = state(trainer, module)
    with ThreadPoolExecutor(1) as flusher:
        target = HostBuffers() if store == "memory" else SnapshotFile(tmp_path / "snap.bin", flusher)
        snap = capture(trainer, module, store=target)
        snap.store.wait_written()  # what `Stability` does before the update
        _restores_bitwise(trainer, module, snap, before)
        target.close()
    assert not (tmp_path / "snap.bin").exists()


def _restores_bitwise(trainer, module, snap, before) -> None:
    assert snap.step == trainer.global_step and snap.applied == trainer.global_step and "torch" in snap.rng
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1.0)
    for s in trainer.optimizers[0].state.values():
        s["exp_avg"].mul_(3.0)
    restore_weights_and_optimizer(trainer, module, snap)
    after = state(trainer, module)
    assert all(torch.equal(a, b) for a, b in zip(before[0], after[0]))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before[1], after[1]) for k in a)
    for s in trainer.optimizers[0].state.values():
        s["exp_avg"].mul_(3.0)  # training after a restore must not reach into the snapshot
    restore_weights_and_optimizer(trainer, module, snap)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(before[1], state(trainer, module)[1]) for k in a)


class SnapshotFiles(L.Callback):
    """The snapshot files on disk at each step's start, after `Stability` took that step's snapshot."""

    def __init__(self) -> None:
        self.seen: dict[int, list[str]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        folder = Path(trainer.default_root_dir) / "stability" / "snapshots"
        self.seen[trainer.global_step] = sorted(p.name for p in folder.glob("*.bin"))


def test_snapshots_become_known_good_only_when_their_own_step_was_healthy(make_cfg, tmp_path):
    files = SnapshotFiles()
    objs = fit(make_cfg(*FAST), files)
    recovery = stability_of(objs["trainer"]).recovery
    assert [s.step for s in recovery.good] == [4, 8]  # every 4 steps, the last 2 kept (12 steps: 0, 4, 8)
    # On a CPU (`store: auto`) each snapshot is a file of the rank's, reused once dropped: keep + 1 of them.
    assert recovery.where == "disk" and files.seen[0] == ["rank0-1.bin"] and len(files.seen[8]) == 3
    assert not (tmp_path / "run" / "stability" / "snapshots").exists()  # files and folder removed at the end

    # NaN weights from step 4 on: the snapshot of step 4 is taken before the fault, but its step is non-finite,
    # so it is dropped; the rollback goes to the step-0 snapshot, read back bitwise from its file.
    for store, source in (("auto", "snapshot_file"), ("memory", "memory")):
        objs = fit(
            make_cfg(
                *FAST,
                "callbacks.stability.guard.max_consecutive=2",
                f"callbacks.stability.recovery.store={store}",
                faults({"kind": "nan_weight", "step": 4, "param": "blocks.1.mlp.fc.weight"}),
                out=tmp_path / f"nan-{store}",
            )
        )
        rollback = [e["detail"] for e in read_events(tmp_path / f"nan-{store}") if e["kind"] == "rollback"]
        assert rollback[0]["source"] == source and rollback[0]["to_step"] == 0
        assert all(p.isfinite().all() for p in objs["module"].parameters())


def test_where_snapshot_files_cannot_be_written_the_run_keeps_them_in_memory(make_cfg, tmp_path, caplog):
    (tmp_path / "run" / "stability").mkdir(parents=True)
    (tmp_path / "run" / "stability" / "snapshots").write_text("a file where the folder would go")
    objs = fit(
        make_cfg(
            *FAST,
            "callbacks.stability.guard.max_consecutive=2",
            faults({"kind": "nan_weight", "step": 6, "param": "blocks.1.mlp.fc.weight"}),
        )
    )
    assert stability_of(objs["trainer"]).recovery.where == "memory"
    assert "snapshots are kept in host memory" in caplog.text
    rollback = [e["detail"] for e in read_events(tmp_path / "run") if e["kind"] == "rollback"]
    assert rollback[0]["source"] == "memory" and rollback[0]["to_step"] == 4


def test_a_disk_that_fills_up_under_a_snapshot_write_costs_that_snapshot_only(make_cfg, tmp_path, caplog, monkeypatch):
    def full(path, mode):
        return open(os.devnull if "r" in mode else "/dev/full", mode)  # a write there: ENOSPC

    monkeypatch.setattr(snapshot_store, "open", full, raising=False)  # the background save of every file fails
    objs = fit(
        make_cfg(
            *FAST,
            "callbacks.stability.guard.max_consecutive=2",
            faults({"kind": "nan_weight", "step": 6, "param": "blocks.1.mlp.fc.weight"}),
        )
    )
    monkeypatch.undo()
    recovery = stability_of(objs["trainer"]).recovery
    assert recovery.where == "memory" and "No space left on device" in caplog.text
    # Step 0's file failed and was dropped; from step 4 on the snapshots are in memory, and the rollback uses one.
    rollback = [e["detail"] for e in read_events(tmp_path / "run") if e["kind"] == "rollback"]
    assert rollback[0]["source"] == "memory" and rollback[0]["to_step"] == 4
    assert all(p.isfinite().all() for p in objs["module"].parameters())


def test_under_auto_a_write_that_holds_the_update_up_moves_the_snapshots_to_memory(
    make_cfg, tmp_path, caplog, monkeypatch
):
    monkeypatch.setattr(recovery_module, "SLOW_WRITE", 0.0)  # any wait at all counts as a slow disk
    monkeypatch.setattr(recovery_module, "SLOW_WRITE_MIN_S", 0.0)
    files = SnapshotFiles()
    objs = fit(make_cfg(*FAST), files)
    recovery = stability_of(objs["trainer"]).recovery
    assert recovery.where == "memory" and "held the update up" in caplog.text
    # The step-0 snapshot (no interval to judge it by) and step 4's were files; from step 8 on, host memory.
    assert files.seen[4] == ["rank0-1.bin", "rank0-2.bin"] and files.seen[8] == files.seen[4]
    assert [s.store.kind for s in recovery.good] == ["disk", "memory"]


def test_a_killed_run_s_snapshot_files_are_removed_by_the_next_start(make_cfg, tmp_path):
    folder = tmp_path / "run" / "stability" / "snapshots"
    folder.mkdir(parents=True)
    (folder / "rank0-7.bin").write_bytes(b"left by a killed run")
    (folder / "rank1-1.bin").write_bytes(b"another rank's")
    fit(make_cfg(*FAST))
    assert sorted(p.name for p in folder.iterdir()) == ["rank1-1.bin"]


def test_a_bad_store_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^callbacks.stability.recovery.store='ram' is not allowed; use one of"):
        Recovery(store="ram")


def test_without_recovery_settings_a_rollback_reads_the_checkpoint_on_disk(make_cfg, tmp_path):
    fit(
        make_cfg(
            *FAST,
            "callbacks.stability.recovery=null",
            "callbacks.stability.guard.max_consecutive=2",
            faults({"kind": "nan_weight", "step": 6, "param": "blocks.1.mlp.fc.weight"}),
        )
    )
    rollback = [e["detail"] for e in read_events(tmp_path / "run") if e["kind"] == "rollback"]
    assert rollback[0]["source"] == "disk" and rollback[0]["to_step"] == 4


def test_snapshot_bench_quick_prints_the_cost_ratio():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "snapshot_bench.py"), "--quick", "--rounds", "1", "--only", "tiny"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "capture/(every*step)" in proc.stdout and "tiny" in proc.stdout


def test_on_a_gpu_the_snapshot_is_pinned_and_asynchronous_and_reads_the_weights_from_before_the_update():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from types import SimpleNamespace

    net = torch.nn.Linear(1024, 1024, device="cuda")
    opt = torch.optim.AdamW(net.parameters(), lr=1.0, fused=True)
    net(torch.randn(8, 1024, device="cuda")).sum().backward()
    opt.step()
    trainer = SimpleNamespace(optimizers=[opt], global_step=1)
    module = SimpleNamespace(parameters=net.parameters, buffers=net.buffers, applied_steps=lambda: 1)
    before = [p.detach().cpu().clone() for p in net.parameters()]
    snap = capture(trainer, module)
    assert snap.store.event is not None and all(t.is_pinned() for t in snap.store.buffers)
    opt.step()  # enqueued after the copies on the same stream: it cannot change what they read
    snap.store.wait()
    assert all(torch.equal(a, b) for a, b in zip(before, snap.weights()))


def test_a_pinned_snapshot_outlives_keep_and_is_where_a_rewind_goes():
    """`Recovery.pin` (a forecast's): the snapshot from before the growth stays past `keep`, a rewind to before the
    growth finds it when the kept ones are all newer, and `unpin` hands its storage back for reuse."""
    from collections import deque
    from types import SimpleNamespace

    from steadylm.stability.recovery import Recovery

    def snap(step):
        return SimpleNamespace(step=step, applied=step, store=SimpleNamespace(kind="memory", close=lambda: None))

    rec, old, new = Recovery(keep=1), snap(0), snap(25)
    rec.good = deque([old])
    rec.pin(before=5)
    rec.candidate = new
    rec.confirm(SimpleNamespace(step=25, nonfinite=False, loss=2.0), suspect=False)
    assert list(rec.good) == [new] and rec._spare is not old  # rotated out of `keep`, its storage held
    chosen = []
    rec._restore = lambda trainer, module, s: chosen.append(s) or {"to_step": s.step}
    rec.rewind(SimpleNamespace(global_step=40), None, before=-1, latest=10)
    assert chosen == [old]
    rec.unpin()
    assert rec.pinned is None and rec._spare is old
