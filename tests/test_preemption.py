"""Preemption: a signal ends the run at a step boundary with a checkpoint, exit 75 and `status: preempted`;
under DDP every rank stops at the same step; `resume=auto` then continues bitwise; SLURM's pre-timeout
signal requeues the job once."""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import stat
import time
from pathlib import Path

import lightning as L
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from steadylm.checkpointing import safe_load
from steadylm.errors import ConfigError
from steadylm.preemption import Preemption, signal_numbers, submitit_signal
from steadylm.requeue import PREEMPTED_EXIT, requeue, resume_command, slurm_requeue_command
from steadylm.result import finish_job
from steadylm.resume import latest_checkpoint
from steadylm.sweep import summarize_sweep
from steadylm.train import train
from tests.helpers import CLI_TINY, DDP_TWO_CPU, cli_steps, run_cli

STEPS = 8
# Dropout makes the losses depend on the RNG stream; no periodic checkpoint, so a resume can only come
# from the preemption's own; validation every 3 steps falls next to the signal's step.
EXACT = [
    *(o for o in CLI_TINY if not o.startswith("trainer.max_steps")),
    f"trainer.max_steps={STEPS}",
    "model.dropout=0.1",
    "callbacks.checkpoint.every_n_train_steps=1000",
]


def drill(step: int, name: str = "SIGTERM", rank: int = 0) -> str:
    return f"+callbacks.drill={{_target_: steadylm.preemption_drill.SignalAtStep, step: {step}, signal: {name}, rank: {rank}}}"


def processes_running(text: str, wait_s: float = 10.0) -> list[str]:
    """Command lines of live processes that contain `text`, after giving them `wait_s` to exit."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                argv = cmdline.read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue  # exited while we looked
            if any(text in arg for arg in argv):
                found.append(" ".join(argv))
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def step_losses(run: Path) -> dict[int, float]:
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("train/loss")}


# --- fast: the pieces ------------------------------------------------------------------------------


def test_signal_names_are_checked():
    assert signal_numbers(["SIGTERM", "usr1"], "k") == [signal.SIGTERM, signal.SIGUSR1]
    with pytest.raises(ConfigError, match="callbacks.preemption.signals has 'SIGKILL'"):
        Preemption(dirpath=".", signals=("SIGKILL",))
    with pytest.raises(ConfigError, match="every_n_steps=0 must be >= 1"):
        Preemption(dirpath=".", every_n_steps=0)


def test_resume_command_keeps_the_overrides_and_pins_the_run_dir():
    command = resume_command(
        "/runs/a b", ["model=small", "resume=auto", "ckpt_path=x.ckpt", "optim.lr=1e-3"], "train.py"
    )
    assert shlex.split(command) == [
        "python",
        "train.py",
        "model=small",
        "optim.lr=1e-3",
        "hydra.run.dir=/runs/a b",
        "resume=auto",
    ]


def test_submitit_jobs_catch_submitit_signal_and_leave_the_requeue_to_it(monkeypatch):
    assert submitit_signal({}) is None
    assert submitit_signal({"SUBMITIT_EXECUTOR": "slurm"}) == signal.SIGUSR2
    assert submitit_signal({"SUBMITIT_EXECUTOR": "slurm", "SUBMITIT_PREEMPT_SIGNAL": "USR1"}) == signal.SIGUSR1
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    callback = Preemption(dirpath="ckpts")
    assert signal.SIGUSR2 in callback.signals
    assert (callback.requeuer(signal.SIGUSR2), callback.requeuer(signal.SIGUSR1)) == ("submitit", "scontrol")
    assert callback.requeuer(signal.SIGTERM) is None
    record = {"requeue": "submitit"}  # submitit's handler requeues: never a second `scontrol requeue`
    assert requeue(record, {"SLURM_JOB_ID": "5"}) == "; submitit requeues the job, and it resumes by itself"


def test_slurm_requeue_names_the_job_or_the_array_task():
    assert slurm_requeue_command({}) is None
    assert slurm_requeue_command({"SLURM_JOB_ID": "77"}) == ["scontrol", "requeue", "77"]
    env = {"SLURM_JOB_ID": "78", "SLURM_ARRAY_JOB_ID": "70", "SLURM_ARRAY_TASK_ID": "3"}
    assert slurm_requeue_command(env) == ["scontrol", "requeue", "70_3"]


@pytest.mark.parametrize(
    ("name", "callbacks", "accumulate"), [("SIGTERM", "default", 1), ("SIGINT", "none", 1), ("SIGUSR1", "default", 2)]
)
def test_signal_stops_at_the_next_step_boundary_with_a_checkpoint(make_cfg, tmp_path, name, callbacks, accumulate):
    """In-process: the signal at step 4 ends training after step 5 with preempted.ckpt, also with
    callbacks=none (Preemption is always there) and inside gradient accumulation (a step, not a batch)."""
    cfg = make_cfg(
        f"callbacks={callbacks}",
        f"trainer.accumulate_grad_batches={accumulate}",
        "trainer.max_steps=20",
        "trainer.val_check_interval=5",  # optimizer steps: validation due at step 5
        drill(4, name),
    )
    previous = signal.getsignal(signal.SIGTERM)
    _, objects = train(cfg)
    trainer = objects["trainer"]
    record = next(c for c in trainer.callbacks if isinstance(c, Preemption)).record
    ckpt = tmp_path / "run" / "checkpoints" / "preempted.ckpt"
    assert record == {
        "signal": name,
        "step": 5,
        "checkpoint": str(ckpt),
        "requeue": "scontrol" if name == "SIGUSR1" else None,
    }
    assert trainer.global_step == 5 and not trainer.received_sigterm
    assert "val/loss" not in trainer.callback_metrics  # the validation due at step 5 is skipped on the way out
    assert latest_checkpoint(ckpt.parent) == ckpt  # nothing newer (last.ckpt at an end-of-epoch state) for resume=auto
    state = safe_load(ckpt)
    assert state["global_step"] == 5
    assert state["ShardDataModule"]["train_sampler"]["batches_done"] == 5 * accumulate
    assert signal.getsignal(signal.SIGTERM) is previous  # the handlers are put back after training
    if callbacks == "default":
        assert not (tmp_path / "run" / "checkpoints" / "exception.ckpt").exists()  # not an exception

    finish_job(cfg, {"train/loss": 4.0}, preempted=record)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "preempted" and result["step"] == 5 and result["checkpoint"] == str(ckpt)
    assert result["reason"] == f"{name} at step 5"


class SigtermBeforeOurHandlers(L.Callback):
    def on_train_start(self, trainer, pl_module):  # runs before Preemption's (last): Lightning's handler is in place
        os.kill(os.getpid(), signal.SIGTERM)


def test_a_sigterm_before_our_handlers_is_a_preemption_without_a_checkpoint(make_cfg, tmp_path):
    """Lightning's own SIGTERM handler, in place until `on_train_start`, stops the run: recorded as preempted."""
    cfg = make_cfg(
        "trainer.max_steps=20", "+callbacks.early={_target_: tests.test_preemption.SigtermBeforeOurHandlers}"
    )
    _, objects = train(cfg)
    record = next(c for c in objects["trainer"].callbacks if isinstance(c, Preemption)).record
    assert record == {
        "signal": "SIGTERM",
        "step": 1,
        "checkpoint": None,
        "requeue": None,
    }  # Lightning stops after a step
    assert not (tmp_path / "run" / "checkpoints" / "preempted.ckpt").exists()


def test_a_second_ctrl_c_interrupts_at_once(make_cfg, tmp_path):
    """Two SIGINTs in one step: the second does not wait for the boundary (Lightning's interrupt, exit 1)."""
    second = "+callbacks.drill2={_target_: steadylm.preemption_drill.SignalAtStep, step: 4, signal: SIGINT}"
    previous = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as stopped:
            train(make_cfg("trainer.max_steps=20", drill(4, "SIGINT"), second))
    finally:
        signal.signal(signal.SIGINT, previous)  # Lightning leaves SIGINT ignored after its interrupt
    assert stopped.value.code == 1
    assert safe_load(tmp_path / "run" / "checkpoints" / "exception.ckpt")["global_step"] == 4
    assert not (tmp_path / "run" / "checkpoints" / "preempted.ckpt").exists()


def test_sweep_summary_shows_a_preempted_job(tmp_path):
    for job, result in enumerate(
        [{"status": "ok", "val_loss": 2.0}, {"status": "preempted", "reason": "SIGTERM at step 40", "val_loss": None}]
    ):
        (tmp_path / str(job) / ".hydra").mkdir(parents=True)
        (tmp_path / str(job) / ".hydra" / "overrides.yaml").write_text(f"- optim.lr={job + 1}e-3\n")
        (tmp_path / str(job) / "result.json").write_text(json.dumps({**result, "lr": (job + 1) * 1e-3}))
    summarize_sweep(tmp_path)
    rows = (tmp_path / "summary.md").read_text().splitlines()
    row = next(r for r in rows if r.startswith("| 1 |"))
    assert "| preempted | SIGTERM at step 40 |" in row


# --- slow: real train.py processes ---------------------------------------------------------------


def preempt_and_resume(shards_dir: Path, tmp_path: Path, extra: list[str], step: int, rank: int, stop: int):
    """An uninterrupted run and one signalled at `step` on `rank`; the latter must stop after step `stop`
    with exit 75, then the printed resume command finishes it. Returns both runs' losses."""
    full, split = tmp_path / "full", tmp_path / "split"
    args = [*EXACT, *extra, f"data.dir={shards_dir}"]
    done = run_cli(*args, f"hydra.run.dir={full}", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

    stopped = run_cli(*args, f"hydra.run.dir={split}", drill(step, rank=rank), cwd=tmp_path, timeout=120)
    assert stopped.returncode == PREEMPTED_EXIT, stopped.stderr[-2000:]
    assert processes_running(f"hydra.run.dir={split}") == []  # every rank exited; none hangs in a collective
    ckpt = split / "checkpoints" / "preempted.ckpt"
    lines = [line for line in stopped.stderr.splitlines() if line.startswith("preempted:")]
    assert len(lines) == 1, stopped.stderr[-2000:]  # one line, from rank 0 only
    assert lines[0].startswith(f"preempted: SIGTERM at step {stop}, state saved in {ckpt}; resume with: python ")
    assert safe_load(ckpt)["global_step"] == stop
    result = json.loads((split / "result.json").read_text())
    assert (result["status"], result["step"], result["checkpoint"]) == ("preempted", stop, str(ckpt))
    assert max(step_losses(split)) == stop - 1  # TensorBoard steps are 0-based: nothing past the stop

    command = shlex.split(lines[0].split("resume with: ", 1)[1])
    assert command[-2:] == [f"hydra.run.dir={split}", "resume=auto"]
    resumed = run_cli(*command[2:], cwd=tmp_path, timeout=120)  # the printed command, as the user runs it
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert json.loads((split / "result.json").read_text())["status"] == "ok"
    return step_losses(full), step_losses(split)


@pytest.mark.slow
def test_sigterm_at_a_random_step_then_resume_auto_is_bitwise_exact(shards_dir, tmp_path):
    step = random.randrange(1, STEPS - 2)
    expected, got = preempt_and_resume(shards_dir, tmp_path, [], step, rank=0, stop=step + 1)
    assert len(expected) == STEPS and got == expected, f"signal at step {step}"


@pytest.mark.slow
def test_ddp_signal_to_one_rank_stops_both_at_one_step_and_resumes_bitwise(shards_dir, tmp_path):
    """SIGTERM to rank 1 only (Lightning's own handling would never see it on rank 0): the flag reaches
    every rank one poll late, both save one checkpoint at the same step, and the resume is exact. Under
    muP (a quarter of its base width here), so its per-group LR multipliers are exercised over DDP and resume."""
    step = random.randrange(1, STEPS - 3)
    extra = [*DDP_TWO_CPU, "model.parametrization=mup"]
    expected, got = preempt_and_resume(shards_dir, tmp_path, extra, step, rank=1, stop=step + 2)
    assert len(expected) == STEPS and got == expected, f"signal at step {step}"


@pytest.mark.slow
def test_slurm_pre_timeout_signal_checkpoints_and_requeues_once(shards_dir, tmp_path):
    """SIGUSR1 under SLURM: one `scontrol requeue <job>` (ours, after the checkpoint; not Lightning's
    hpc_ckpt from inside the handler), exit 75; the requeued job's own command resumes it."""
    calls = tmp_path / "scontrol.calls"
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_PROCID": "0"}
    slurm |= {"SLURM_LOCALID": "0", "SLURM_NODEID": "0", "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    run = tmp_path / "run"
    args = [*EXACT, f"data.dir={shards_dir}", f"hydra.run.dir={run}", "resume=auto"]  # what an sbatch script runs

    stopped = run_cli(*args, drill(3, "SIGUSR1"), cwd=tmp_path, timeout=120, env=slurm)
    assert stopped.returncode == PREEMPTED_EXIT, stopped.stderr[-2000:]
    assert calls.read_text() == "requeue 4242\n"
    assert "requeued SLURM job 4242" in stopped.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["preempted.ckpt"]
    assert not list(run.rglob("hpc_ckpt_*.ckpt"))

    again = run_cli(*args, cwd=tmp_path, timeout=120, env=slurm)  # the requeued job: the same command
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resume=auto: continuing from" in again.stdout + again.stderr and "preempted.ckpt" in again.stderr
    assert safe_load(run / "checkpoints" / "last.ckpt")["global_step"] == STEPS
    assert calls.read_text() == "requeue 4242\n"  # a run that finishes does not requeue


@pytest.mark.slow
def test_submitit_launcher_signal_checkpoints_requeues_and_the_job_resumes_bitwise(shards_dir, tmp_path):
    """The template's submitit launcher, run for real (its local executor: the same signal handling and
    requeue decision as on SLURM, with a restart for `scontrol requeue`): submitit's SIGUSR2 stops the job at
    the next step boundary with preempted.ckpt, submitit requeues it, and the requeued job, started by
    submitit with the same command (no resume=auto), continues from that checkpoint to the same losses as an
    uninterrupted run."""
    step = random.randrange(1, STEPS - 2)
    args = [*EXACT, f"data.dir={shards_dir}"]
    full, sweep = tmp_path / "full", tmp_path / "sweep"
    done = run_cli(*args, f"hydra.run.dir={full}", cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

    launcher = ["hydra/launcher=submitit_local", "hydra.launcher.timeout_min=60", f"hydra.sweep.dir={sweep}"]
    proc = run_cli("-m", *launcher, *args, drill(step, "SIGUSR2"), cwd=tmp_path, timeout=240)
    logs = "".join(p.read_text() for p in sorted((sweep / ".submitit").rglob("*_log.*")))
    assert proc.returncode == 0, proc.stderr[-2000:] + logs[-3000:]
    lines = [line for line in logs.splitlines() if line.startswith("preempted:")]
    assert len(lines) == 1 and lines[0].startswith(f"preempted: SIGUSR2 at step {step + 1}, state saved in "), logs
    assert lines[0].endswith(
        f"hydra.run.dir={sweep / '0'} resume=auto; submitit requeues the job, and it resumes by itself"
    )
    assert "resume with: python train.py " in lines[0]  # the user's script, not submitit's entry point
    assert "submitit requeued this job: continuing from" in logs and "preempted.ckpt" in logs
    run = sweep / "0"
    assert safe_load(run / "checkpoints" / "preempted.ckpt")["global_step"] == step + 1
    assert json.loads((run / "result.json").read_text())["status"] == "ok"  # the requeued job finished it
    assert step_losses(run) == step_losses(full), f"signal at step {step}"


@pytest.mark.slow
def test_a_signal_in_a_multirun_ends_the_sweep_with_its_summary(shards_dir, tmp_path):
    """The signal is for the process: job 0 is recorded as preempted, job 1 never starts, and the summary
    of the jobs so far shows it."""
    proc = run_cli("-m", "optim.lr=1e-3,2e-3", f"data.dir={shards_dir}", *CLI_TINY, drill(2), cwd=tmp_path, timeout=120)
    assert proc.returncode == PREEMPTED_EXIT, proc.stderr[-2000:]
    sweep = next((tmp_path / "logs" / "train" / "multiruns").iterdir())
    assert json.loads((sweep / "0" / "result.json").read_text())["status"] == "preempted"
    assert not (sweep / "1").exists()
    rows = (sweep / "summary.md").read_text().splitlines()
    row = next(r for r in rows if r.startswith("| 0 |"))
    assert "| preempted | SIGTERM at step 3 |" in row
    assert "(1 jobs, 0 unstable, 0 diverged, 1 preempted)" in proc.stdout  # the summary callback's own line
    assert f"hydra.run.dir={sweep / '0'} resume=auto" in proc.stderr  # that job alone, without -m


class SignalTheSweep(L.Callback):
    """Rank 0 of a sweep job sends `signal` to its parent, the job's process (in a sequential sweep: the sweep), as
    step `step` starts; each step lasts `sleep` seconds more, so the signal comes back to the ranks mid-run."""

    def __init__(self, step: int, signal: str = "SIGTERM", sleep: float = 0.2):
        self.step, self.signum, self.sleep = int(step), signal, float(sleep)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        time.sleep(self.sleep)
        if trainer.global_rank == 0 and trainer.global_step == self.step:
            os.kill(os.getppid(), getattr(signal, self.signum))


@pytest.mark.slow
def test_a_signal_to_a_sweep_of_two_process_jobs_then_resume_auto_finishes_the_sweep(shards_dir, tmp_path):
    """`-m` on 2 processes a job: SIGUSR1 to the sweep (torch's launcher holds the job's ranks) reaches both ranks,
    which stop job 0 at one step (preempted.ckpt); then the summary so far and exit 75. The same command with
    resume=auto continues job 0 from it and runs job 1; once more, both are finished and skipped (the callback that
    sends the signal is left out of the commands that resume)."""
    steps = cli_steps(12)
    args = ["-m", "trainer=ddp_sim", "optim.lr=1e-3,2e-3", f"data.dir={shards_dir}", *steps]
    signal_it = "+callbacks.signal={_target_: test_preemption.SignalTheSweep, step: 2, signal: SIGUSR1}"
    proc = run_cli(*args, signal_it, cwd=tmp_path, timeout=240)
    assert proc.returncode == PREEMPTED_EXIT, proc.stderr[-2000:]
    sweep = next((tmp_path / "logs" / "train" / "multiruns").iterdir())
    assert (sweep / "0" / "checkpoints" / "preempted.ckpt").is_file() and not (sweep / "1").exists()
    assert "(1 jobs, 0 unstable, 0 diverged, 1 preempted)" in proc.stdout
    stopped = safe_load(sweep / "0" / "checkpoints" / "preempted.ckpt")["global_step"]
    assert 3 <= stopped < 12  # a step or two after the signal came back to the ranks
    result = json.loads((sweep / "0" / "result.json").read_text())
    assert (result["status"], result["reason"]) == ("preempted", f"SIGUSR1 at step {stopped}")
    lines = [line for line in proc.stderr.splitlines() if line.startswith("preempted:")]
    assert len(lines) == 1 and lines[0].startswith(f"preempted: SIGUSR1 at step {stopped}, state saved in ")
    assert lines[0].endswith(f"hydra.run.dir={sweep / '0'} resume=auto")  # that job alone, without -m
    assert processes_running(str(sweep)) == []

    proc = run_cli(*args, "resume=auto", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in (tmp_path / "logs" / "train" / "multiruns").iterdir()] == [sweep.name]  # the same sweep
    assert f"resume=auto: continuing from {sweep / '0' / 'checkpoints' / 'preempted.ckpt'}" in proc.stdout
    results = [json.loads((sweep / job / "result.json").read_text()) for job in ("0", "1")]
    assert [(r["status"], r["lr"]) for r in results] == [("ok", 1e-3), ("ok", 2e-3)]
    assert safe_load(sweep / "0" / "checkpoints" / "last.ckpt")["global_step"] == 12
    assert f"sweep summary: {sweep / 'summary.md'} (2 jobs, 0 unstable, 0 diverged)" in proc.stdout

    proc = run_cli(*args, "resume=auto", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert all(f"resume=auto: {sweep / job} finished (ok), skipped" in proc.stdout for job in ("0", "1"))
    assert "Initializing distributed" not in proc.stderr  # nothing was trained again
