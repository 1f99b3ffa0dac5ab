"""`hydra/launcher=parallel`: a sweep's jobs side by side, one slot each (here: one CPU core each), the rest queued;
the summary lists every job, a failed job leaves the others running, a signal stops every running job resumably."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
import torch

from steadylm.checkpointing import safe_load
from steadylm.errors import ConfigError
from steadylm.parallel import plan_slots
from steadylm.requeue import PREEMPTED_EXIT
from tests.helpers import CLI_TINY, ROOT, cli_env, cli_steps, run_cli
from tests.test_jobs import alive
from tests.test_preemption import processes_running

PARALLEL = ["-m", "hydra/launcher=parallel", "hydra.launcher.slots=2", "trainer=cpu"]


class SlotProbe(L.Callback):
    """Writes what the job's process saw into its run dir (`slot.json`): pid, its fit's start and end, torch's
    thread count, CPU affinity, OMP_NUM_THREADS; `sleep` seconds a step lengthens a job; `training` once a step ran."""

    def __init__(self, sleep: float = 0.0):
        self.sleep, self.seen = float(sleep), {}

    def _write(self, trainer) -> None:
        Path(trainer.default_root_dir, "slot.json").write_text(json.dumps(self.seen))

    def on_fit_start(self, trainer, pl_module):
        affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self.seen = {"pid": os.getpid(), "start": time.time(), "threads": torch.get_num_threads(), "cpus": affinity}
        self.seen["omp"] = os.environ.get("OMP_NUM_THREADS")
        self._write(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.sleep)
        Path(trainer.default_root_dir, "training").touch()

    def on_fit_end(self, trainer, pl_module):
        self.seen["end"] = time.time()
        self._write(trainer)


def probe(sleep: float) -> str:
    return f"+callbacks.probe={{_target_: test_parallel.SlotProbe, sleep: {sleep}}}"


def test_slots_default_to_gpus_over_devices_and_to_one_on_a_cpu():
    gpus = ["0", "1", "2", "3"]
    assert [s["gpus"] for s in plan_slots(None, 1, gpus, [0])] == [["0"], ["1"], ["2"], ["3"]]
    assert [s["gpus"] for s in plan_slots(None, 2, gpus, [0])] == [["0", "1"], ["2", "3"]]
    assert [s["gpus"] for s in plan_slots(None, "auto", gpus, [0])] == [["0"], ["1"], ["2"], ["3"]]  # one a job
    assert [s["gpus"] for s in plan_slots(2, "auto", gpus, [0])] == [["0", "1"], ["2", "3"]]
    assert [s["gpus"] for s in plan_slots(1, 1, ["4", "6"], [0])] == [["4"]]  # CUDA_VISIBLE_DEVICES=4,6 kept
    assert plan_slots(None, 1, [], [0, 1, 2, 3]) == [{"gpus": [], "cpus": [0, 1, 2, 3]}]
    assert [s["cpus"] for s in plan_slots(2, 1, [], [0, 1, 2, 3, 4])] == [[0, 1], [2, 3]]
    for slots, devices, gpus, message in [
        (0, 1, [], "hydra.launcher.slots=0 must be a whole number >= 1"),
        ("two", 1, [], "hydra.launcher.slots='two' must be"),
        (3, 1, [], "hydra.launcher.slots=3 is more than the 2 CPU cores"),
        (3, 2, ["0", "1", "2", "3"], "hydra.launcher.slots=3 x trainer.devices=2 needs 6 GPUs, 4 are visible"),
    ]:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("+", r"\+")):
            plan_slots(slots, devices, gpus, [0, 1])


def test_a_bad_slots_value_is_one_line_and_exit_2(shards_dir, tmp_path):
    proc = run_cli(
        *PARALLEL, "hydra.launcher.slots=0", "optim.lr=1e-3,2e-3", f"data.dir={shards_dir}", *CLI_TINY, cwd=tmp_path
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: hydra.launcher.slots=0 must be a whole number")
    assert "Traceback" not in proc.stderr


@pytest.mark.slow
def test_four_jobs_on_two_slots_run_two_at_once_each_on_its_core_and_a_failed_job_leaves_the_others(
    shards_dir, tmp_path
):
    """Jobs 0-2 train (one core each, one thread, at most two at once); job 3's LR is a typo: it fails alone (its
    `failed` row), the others finish and the summary lists all four."""
    proc = run_cli(
        *PARALLEL, "optim.lr=1e-3,2e-3,3e-3,oops", f"data.dir={shards_dir}", *CLI_TINY, probe(0.3), cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = next((tmp_path / "logs" / "train" / "multiruns").iterdir())
    logs = proc.stdout + proc.stderr  # Hydra's log lines go to stdout
    assert "parallel sweep: 4 jobs on 2 slots (core " in logs and "job 0 finished: ok" in logs
    assert "job 3 failed: InterpolationResolutionError: " in logs  # optim.min_lr = a fraction of 'oops'"
    assert f"sweep summary: {sweep / 'summary.md'} (4 jobs, 0 unstable, 0 diverged, 1 failed)" in proc.stdout
    results = [json.loads((sweep / str(i) / "result.json").read_text()) for i in range(3)]
    assert [(r["status"], r["lr"]) for r in results] == [("ok", 1e-3), ("ok", 2e-3), ("ok", 3e-3)]
    table = (sweep / "summary.md").read_text()
    row = next(r for r in table.splitlines() if r.startswith("| 3 |"))
    assert "| — | — | failed | InterpolationResolutionError: " in row and "full_key: optim.min_lr" in row

    seen = [json.loads((sweep / str(i) / "slot.json").read_text()) for i in range(3)]
    assert len({s["pid"] for s in seen}) == 3 and os.getpid() not in {s["pid"] for s in seen}  # a process a job
    assert all(s["threads"] == 1 and s["omp"] == "1" and len(s["cpus"]) == 1 for s in seen)
    assert seen[0]["cpus"] != seen[1]["cpus"]  # the two first jobs on two cores
    events = sorted([(s["start"], 1) for s in seen] + [(s["end"], -1) for s in seen])
    running = [sum(d for _, d in events[: i + 1]) for i in range(len(events))]
    assert max(running) == 2  # side by side, never three at once


@pytest.mark.slow
def test_a_sigterm_stops_every_running_job_resumably_and_resume_auto_finishes_the_sweep(shards_dir, tmp_path):
    """SIGTERM to the sweep once jobs 0 and 1 train: both stop with preempted.ckpt, jobs 2 and 3 never start, the
    summary lists the two, exit 75; the same command with resume=auto continues 0 and 1 and runs 2 and 3."""
    steps = cli_steps(12)
    args = [*PARALLEL, "optim.lr=1e-3,2e-3,3e-3,4e-3", f"data.dir={shards_dir}", *steps, probe(0.5)]
    env = cli_env(tmp_path)
    sweep_root = tmp_path / "logs" / "train" / "multiruns"
    with subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        deadline = time.monotonic() + 180
        while not all(any(sweep_root.glob(f"*/{job}/training")) for job in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "jobs 0 and 1 never trained"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == PREEMPTED_EXIT, err[-3000:]
    sweep = next(sweep_root.iterdir())
    for job in ("0", "1"):
        assert json.loads((sweep / job / "result.json").read_text())["status"] == "preempted"
        assert (sweep / job / "checkpoints" / "preempted.ckpt").is_file()
    assert not (sweep / "2").exists() and not (sweep / "3").exists()
    assert "(2 jobs, 0 unstable, 0 diverged, 2 preempted)" in out
    assert "rerun the same command with resume=auto to continue it" in err

    again = run_cli(*args, "resume=auto", cwd=tmp_path, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert [p.name for p in sweep_root.iterdir()] == [sweep.name]  # the same sweep folder
    for job in ("0", "1"):
        assert "resume=auto: continuing from" in (sweep / job / "train.log").read_text()
    results = [json.loads((sweep / str(i) / "result.json").read_text()) for i in range(4)]
    assert [(r["status"], r["lr"]) for r in results] == [("ok", 1e-3), ("ok", 2e-3), ("ok", 3e-3), ("ok", 4e-3)]
    assert all(safe_load(sweep / str(i) / "checkpoints" / "last.ckpt")["global_step"] == 12 for i in range(4))
    assert f"sweep summary: {sweep / 'summary.md'} (4 jobs, 0 unstable, 0 diverged)" in again.stdout


@pytest.mark.slow
def test_a_sigkill_of_the_parallel_sweep_leaves_no_job_running(shards_dir, tmp_path):
    """Both jobs train side by side; the sweep is SIGKILLed: each job's process follows it within seconds (none goes
    on writing a folder that `resume=auto` would start again)."""
    steps = cli_steps(1000)
    args = [*PARALLEL, "optim.lr=1e-3,2e-3", f"data.dir={shards_dir}", *steps, probe(0.2)]
    env = cli_env(tmp_path)
    sweep_root = tmp_path / "logs" / "train" / "multiruns"
    with subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL
    ) as proc:
        try:
            deadline = time.monotonic() + 180
            while not all(any(sweep_root.glob(f"*/{job}/training")) for job in (0, 1)):
                assert proc.poll() is None and time.monotonic() < deadline, "jobs 0 and 1 never trained"
                time.sleep(0.2)
        finally:
            proc.kill()
    sweep = next(sweep_root.iterdir())
    pids = [json.loads((sweep / job / "slot.json").read_text())["pid"] for job in ("0", "1")]
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(pid) for pid in pids)
    assert processes_running(str(sweep)) == []  # nor submitit's job controllers


@pytest.mark.slow
def test_a_parallel_job_on_two_processes_runs_that_job_only(shards_dir, tmp_path):
    """A slot of two devices (here both cores, `trainer=ddp_sim`): each job's extra process runs that job, in its
    folder (Lightning relaunches the training app, not submitit's job runner)."""
    args = ["-m", "hydra/launcher=parallel", "trainer=ddp_sim", "optim.lr=1e-3,2e-3", f"data.dir={shards_dir}"]
    proc = run_cli(*args, *CLI_TINY, "+callbacks.probe._target_=test_distributed.RankProbe", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in (tmp_path / "logs" / "train").iterdir()] == ["multiruns"]  # no child made a run of its own
    sweep = next((tmp_path / "logs" / "train" / "multiruns").iterdir())
    for job in ("0", "1"):
        assert sorted(p.name for p in (sweep / job).glob("rank*.txt")) == ["rank0.txt", "rank1.txt"]
        assert json.loads((sweep / job / "result.json").read_text())["status"] == "ok"
    assert f"sweep summary: {sweep / 'summary.md'} (2 jobs, 0 unstable, 0 diverged)" in proc.stdout


@pytest.mark.slow
def test_optuna_trials_run_side_by_side(shards_dir, tmp_path):
    """`hydra.sweeper.n_jobs=2` hands the launcher two trials at a time; the sweeper gets every trial's val/loss."""
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="optional extra: pip install -e '.[sweep]'")
    search = ["hparams_search=lr_optuna", "hydra.sweeper.n_trials=4", "hydra.sweeper.n_jobs=2"]
    args = [*search, "hydra.sweeper.sampler.n_startup_trials=2", "hydra/launcher=parallel", "hydra.launcher.slots=2"]
    proc = run_cli(*args, "trainer=cpu", f"data.dir={shards_dir}", *CLI_TINY, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = next((tmp_path / "logs" / "train" / "multiruns").iterdir())
    values = [json.loads((sweep / str(i) / "result.json").read_text())["val_loss"] for i in range(4)]
    assert f"best_value: {min(values)}" in (sweep / "optimization_results.yaml").read_text()
    assert "parallel sweep: 2 jobs on 2 slots" in proc.stdout + proc.stderr  # each batch of two trials
