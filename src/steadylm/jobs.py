"""A job of a Hydra multirun (`-m`, either launcher), loaded only by one: the job's own process owns the job.

It skips a job `resume=auto` finds finished, refuses one whose folder another live process is writing (`job.lock`,
held for the job's life), and then trains the job itself on one process or, when the job needs N processes that no
cluster started (SLURM, torchrun), runs them under torch's elastic launcher (torchrun's machinery, in this process)
as `python -m steadylm.train <the job's overrides>`. Lightning sees torchelastic in each rank and relaunches nothing.
When a rank fails, the launcher stops the others (SIGTERM, SIGKILL 30 s later) and this records the first failing
rank's own error as the job's `failed` result; the sweep goes on. A signal to this process reaches every rank, which
stops at a step boundary as one run does. Each rank dies with this process (PR_SET_PDEATHSIG), so a SIGKILL of the
sweep leaves no rank running."""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from steadylm.distributed import JOB_PARENT_ENV, SWEEP_JOB_ENV, is_rank_zero_process
from steadylm.errors import ConfigError, SteadyError, exit_with, one_line
from steadylm.result import RESULT_FILE, finish_job

log = logging.getLogger("steadylm")

LOCK_FILE = "job.lock"
# After a signal, how long the ranks get to stop at a step boundary and save before they are killed.
SIGNAL_GRACE_S = 90
# A rank's error that only says another rank went away (gloo; NCCL): never the first failure when there is another.
PEER_LOST = ("remote worker", "by peer", "DistBackendError", "DistNetworkError", "NCCL communicator")
PR_SET_PDEATHSIG = 1


def finished_job(cfg: DictConfig) -> tuple[float | None, str] | None:
    """A sweep job that `resume=auto` finds already finished (`result.json` other than preempted or failed): the
    metric it handed the sweeper and its status, so the job is skipped, not retrained; None when it has to run."""
    path = Path(cfg.paths.output_dir) / RESULT_FILE
    if cfg.get("resume") != "auto" or not path.is_file():
        return None
    result = json.loads(path.read_text())
    if result.get("status") in ("preempted", "failed"):
        return None
    return sweep_value(cfg, result), result["status"]


def sweep_value(cfg: DictConfig, result: dict) -> float | None:
    """What a job hands a Hydra sweeper, from its result: `optimized_metric` (`val/loss` -> `val_loss`), NaN for a
    job that diverged or failed (a sweeper records the trial as failed), None without a metric."""
    if not (metric := cfg.get("optimized_metric")):
        return None
    if result["status"] in ("diverged", "failed"):
        return float("nan")
    return result.get(str(metric).replace("/", "_"))


def lock_job(folder: Path) -> int:
    """Take `<folder>/job.lock` (flock, this pid written in it) for the job's life: the open descriptor, which the
    kernel releases when this process ends, however it ends. Another live holder is refused in one line."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"{folder} is being written by process {pid} (this sweep, still running); "
            "wait for it or stop it, then rerun with resume=auto"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def processes_to_start(cfg: DictConfig) -> int:
    """How many processes this job must start itself: the trainer's, unless a cluster already started them
    (SLURM's tasks, torchrun's ranks); 1 means it trains in this process."""
    from lightning.fabric.plugins.environments import SLURMEnvironment, TorchElasticEnvironment

    from steadylm.devices import devices_of

    devices = devices_of(cfg)
    slurm_tasks = SLURMEnvironment.detect() and os.environ.get("SLURM_NTASKS") == str(devices.world_size)
    if devices.world_size == 1 or slurm_tasks or TorchElasticEnvironment.detect():
        return 1
    if devices.num_nodes > 1:
        raise ConfigError(
            f"trainer.num_nodes={devices.num_nodes}: a sweep job on several machines needs a cluster launcher "
            "(hydra/launcher=slurm); this machine alone starts one machine's processes"
        )
    return devices.per_node


def run_job(cfg: DictConfig, train_here: Callable[[DictConfig], Any]) -> Any:
    """A sweep job, in its own process: skipped, refused, trained here (`train_here`), or run on its ranks."""
    folder = Path(cfg.paths.output_dir)
    if done := finished_job(cfg):  # `-m ... resume=auto` again: a finished job stays as it is
        print(f"resume=auto: {folder} finished ({done[1]}), skipped")
        return done[0]
    lock = None
    try:
        if is_rank_zero_process():  # SLURM's other tasks of this job (hydra/launcher=slurm) share rank 0's folder
            lock = lock_job(folder)
    except SteadyError as err:  # another process writes this folder: this sweep must not touch it
        exit_with(err)
    try:
        try:
            ranks = processes_to_start(cfg)
        except SteadyError as err:
            return job_failed(cfg, f"error: {one_line(err)}")
        return train_here(cfg) if ranks == 1 else run_ranks(cfg, ranks)
    finally:
        if lock is not None:
            os.close(lock)


def job_failed(cfg: DictConfig, reason: str) -> float | None:
    """Record the job as `failed` (its result.json; the summary's row), say so, hand the sweeper NaN: the next job
    runs."""
    print(f"job failed: {cfg.paths.output_dir}: {reason}", file=sys.stderr, flush=True)
    return finish_job(cfg, {}, failed=reason)[0]


def failed_here(cfg: DictConfig, err: Exception) -> float | None:
    """A job that trained in this process raised: a user's mistake is its one line; anything else leaves its
    traceback in the log and its last line in the row."""
    if isinstance(err, SteadyError):
        return job_failed(cfg, f"error: {one_line(err)}")
    log.exception("job failed: %s", cfg.paths.output_dir)
    return job_failed(cfg, f"{type(err).__name__}: {one_line(err)}")


def run_ranks(cfg: DictConfig, n: int) -> Any:
    """Run the job on `n` processes of this machine under torch's elastic launcher and record how it ended."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    folder = Path(cfg.paths.output_dir)
    overrides = list(HydraConfig.get().overrides.task)
    args = ["-m", "steadylm.train", *overrides, f"hydra.run.dir={folder}", "hydra.output_subdir=null", "hydra.mode=RUN"]
    signals = ",".join(handled_signals(cfg))
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="steadylm-ranks-") as logs, rank_env(folder), restored(signals):
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=n,
            run_id=str(uuid.uuid4()),
            rdzv_backend="c10d",
            rdzv_endpoint="localhost:0",
            max_restarts=0,
            monitor_interval=0.2,
            logs_specs=DefaultLogsSpecs(log_dir=logs),
            signals_to_handle=signals,
            shutdown_timeout=SIGNAL_GRACE_S,
        )
        try:
            elastic_launch(config, sys.executable)(*args)
        except ChildFailedError as err:
            rank, reason = first_failure(err.failures)
            return job_failed(cfg, f"rank {rank}: {reason}")
        except SignalException as err:  # every rank was sent it; each stopped at a step boundary, or was killed
            return ranks_stopped(cfg, signal.Signals(err.sigval).name, started)
    result = fresh_result(folder, started)
    if result is None:
        return job_failed(cfg, "every rank exited 0, but rank 0 wrote no result.json")
    if result["status"] == "preempted":  # a signal to a rank alone (its ranks agreed to stop)
        return ranks_stopped(cfg, result.get("signal", "a signal"), started)
    return sweep_value(cfg, result)


def ranks_stopped(cfg: DictConfig, name: str, started: float) -> None:
    """The job's ranks stopped for a signal: what rank 0 recorded (or, stopped before training, a preemption without a
    checkpoint), then the line, the requeue, the summary so far and exit 75, as a job that trains in this process."""
    from steadylm.requeue import finish_preempted

    result = fresh_result(Path(cfg.paths.output_dir), started) or {}
    record = {k: result.get(k) for k in ("signal", "step", "checkpoint", "requeue")}
    if result.get("status") != "preempted":  # the ranks finished first (their result stands), or never trained
        record = {"signal": name, "step": None, "checkpoint": None, "requeue": None}
        if not result:
            finish_job(cfg, {}, preempted=record)
    finish_preempted(cfg, record)


def fresh_result(folder: Path, since: float) -> dict | None:
    """The job's result.json when rank 0 wrote it after `since` (not one a previous run left)."""
    path = folder / RESULT_FILE
    return json.loads(path.read_text()) if path.is_file() and path.stat().st_mtime >= since - 1 else None


def handled_signals(cfg: DictConfig) -> list[str]:
    """What the elastic launcher catches here and sends to every rank: torch's own and the run's preemption
    signals (SIGUSR1 would otherwise end this process, and its ranks with it)."""
    from steadylm.preemption import submitit_signal

    names = ["SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"]  # not one this process ignores (a parallel job: Ctrl-C)
    preemption = (cfg.get("callbacks") or {}).get("preemption") or {}
    for name in preemption.get("signals") or ("SIGTERM", "SIGINT", "SIGUSR1"):
        names.append("SIG" + str(name).upper().removeprefix("SIG"))
    if (extra := submitit_signal(dict(os.environ))) is not None:
        names.append(signal.Signals(extra).name)
    names = [n for n in names if n in signal.Signals.__members__]
    return [n for n in dict.fromkeys(names) if signal.getsignal(signal.Signals[n]) is not signal.SIG_IGN]


@contextmanager
def restored(signals: str) -> Iterator[None]:
    """The elastic launcher leaves its handlers installed; the sweep's own come back after the job."""
    nums = [signal.Signals[name] for name in signals.split(",")]
    saved = {s: signal.getsignal(s) for s in nums}
    try:
        yield
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


@contextmanager
def rank_env(folder: Path) -> Iterator[None]:
    """What each rank inherits: the job folder (it is a rank of a sweep job) and this process's pid (its parent)."""
    saved = {k: os.environ.get(k) for k in (SWEEP_JOB_ENV, JOB_PARENT_ENV)}
    os.environ[SWEEP_JOB_ENV], os.environ[JOB_PARENT_ENV] = str(folder), str(os.getpid())
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def failure_line(failure: Any) -> str:
    """A rank's own error: the line it recorded (`error: ...` or `<Exception>: ...`), or how it ended."""
    message = failure.message
    if isinstance(message, dict):  # torch's `record`: the exception's line, its traceback beside it
        message = message.get("message", "")
    if failure.exitcode < 0:
        signame = failure.signal_name()
        return f"killed by {signame}" + (f" ({message})" if message and "received by PID" not in message else "")
    if not message or failure.error_file == "<N/A>":
        return f"exited with code {failure.exitcode} (see its log above)"
    return " ".join(str(message).split())


def first_failure(failures: dict[int, Any]) -> tuple[int, str]:
    """The rank whose failure came first, by cause before time: a rank's own error, then a signal it was killed by,
    then the launcher's SIGTERM, then an error that only says a peer went away (every rank but the first sees one)."""

    def order(item: tuple[int, Any]) -> tuple[int, int, int]:
        rank, failure = item
        line = failure_line(failure)
        if any(text in line for text in PEER_LOST):
            cause = 3
        elif failure.exitcode == -signal.SIGTERM and line == "killed by SIGTERM":
            cause = 2
        else:
            cause = 1 if failure.exitcode < 0 else 0
        return cause, failure.timestamp, rank

    rank, failure = min(failures.items(), key=order)
    return rank, failure_line(failure)


def die_with_parent() -> None:
    """In a rank: SIGKILL when the job's process dies (Linux; elsewhere the launcher's own stop is all there is); a
    parent gone before this ran means this rank is already orphaned: exit. (The launcher starts each rank in a
    session of its own, so a terminal's Ctrl-C reaches the job's process alone, which passes it on once.)"""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(os.environ.get(JOB_PARENT_ENV, os.getppid())):
        sys.exit(1)


def as_rank(main: Callable[[], None]) -> None:
    """Run `main` as one rank of a sweep job: dying with the job's process, its exception recorded for the launcher
    (torch's `record`: the error file the job's process reads; a user's mistake records its one line itself)."""
    from torch.distributed.elastic.multiprocessing.errors import record

    die_with_parent()
    record(main)()
