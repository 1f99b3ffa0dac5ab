"""`hydra/launcher=parallel` (the class: `hydra_plugins/steadylm_parallel.py`): a sweep's jobs side by side on one
machine, one device slot each, the rest queued.

submitit's local executor (through hydra-submitit-launcher's `LocalLauncher`) runs each job in a process of its own
with Hydra's job folder and return value, as on SLURM. This adds what it lacks: at most `slots` jobs at once, each
pinned to its slot (its GPUs through `CUDA_VISIBLE_DEVICES`; on a CPU its share of the cores: affinity and thread
count), and a signal to the sweep forwarded to every running job, which stops at a step boundary with
`preempted.ckpt`; then the summary so far and exit 75, as a sequential sweep. Loaded by a parallel sweep and its
jobs only, never by training; it never trains.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from steadylm.errors import ConfigError, exit_with, is_int

log = logging.getLogger("steadylm")

SLOT_ENV = "STEADYLM_PARALLEL_SLOT"  # set in a job of a parallel sweep: its slot, then its cores (`0:2,3`)
SWEEP_PID_ENV = "STEADYLM_PARALLEL_SWEEP"  # and the sweep's pid: the job ends with it
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
PREEMPTED_EXIT = 75  # as steadylm.requeue (not imported: it loads the training stack)


def plan_slots(slots: Any, devices: Any, gpus: list[str], cpus: list[int]) -> list[dict[str, list]]:
    """Each slot's GPUs (when there are any) or CPU cores; a value that cannot work is a ConfigError.
    GPUs: `slots` defaults to GPUs // `trainer.devices` (`auto`: one GPU a job, the job's `auto` then sees the one).
    CPU: one slot by default
    (every core to one job at a time, as a sequential sweep); `slots=N` splits the cores evenly."""
    if slots is not None and (not is_int(slots) or slots < 1):
        raise ConfigError(f"hydra.launcher.slots={slots!r} must be a whole number >= 1 (or null for the default)")
    if gpus:
        per = devices if is_int(devices) and devices > 0 else None  # auto / -1: one GPU a job, or all over `slots`
        if per is None:
            per = max(1, len(gpus) // slots) if slots else 1
        if per > len(gpus) or (slots or 1) * per > len(gpus):
            raise ConfigError(
                f"hydra.launcher.slots={slots or 1} x trainer.devices={per} needs {(slots or 1) * per} GPUs, "
                f"{len(gpus)} are visible: lower hydra.launcher.slots or trainer.devices"
            )
        n = slots or len(gpus) // per
        return [{"gpus": gpus[i * per : (i + 1) * per], "cpus": []} for i in range(n)]
    n = slots or 1
    if n > len(cpus):
        raise ConfigError(
            f"hydra.launcher.slots={n} is more than the {len(cpus)} CPU cores here: one core a job at least"
        )
    per = len(cpus) // n
    return [{"gpus": [], "cpus": cpus[i * per : (i + 1) * per]} for i in range(n)]


def describe(plan: dict[str, list]) -> str:
    """`GPU 3`, `GPUs 0,1`, `core 5`, `cores 0-7`: a slot as the log names it."""
    kind, ids = ("GPU", plan["gpus"]) if plan["gpus"] else ("core", plan["cpus"])
    span = len(ids) > 2 and [int(i) for i in ids] == list(range(int(ids[0]), int(ids[0]) + len(ids)))
    return f"{kind}{'s' if len(ids) > 1 else ''} " + (f"{ids[0]}-{ids[-1]}" if span else ",".join(map(str, ids)))


def visible_gpus(accelerator: Any) -> list[str]:
    """The GPUs a slot can take (`CUDA_VISIBLE_DEVICES` order), none when the trainer runs on the CPU."""
    if str(accelerator) == "cpu":
        return []
    import torch

    count = torch.cuda.device_count()
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        return [str(i) for i in range(count)]
    listed = [g.strip() for g in os.environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()][:count]
    if not all(g.isdigit() for g in listed):
        raise ConfigError(
            "CUDA_VISIBLE_DEVICES names GPUs by UUID; hydra/launcher=parallel needs their indices (0,1,...)"
        )
    return listed


def pin_job() -> None:
    """In a job's process, before Hydra runs it: its slot's cores and threads (the env already holds
    `CUDA_VISIBLE_DEVICES` and `OMP_NUM_THREADS`); a signal before training starts ends the job at once, nothing
    to save (submitit's own SIGTERM handler would only log it, and the job would run to its end)."""
    cores = os.environ.get(SLOT_ENV, "").partition(":")[2]
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    if threads := os.environ.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(threads))

    die_with_sweep()

    def before_training(signum: int, frame: Any) -> None:
        raise SystemExit(PREEMPTED_EXIT)  # the Preemption callback replaces this once training starts

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, before_training)


def die_with_sweep() -> None:
    """A job ends when its sweep's process does, however it ends (a SIGKILL of the sweep leaves no job running, and
    none writing a folder that `resume=auto` would start again): a thread waits on the sweep's pidfd (Linux), then
    kills this process; its ranks die with it (jobs.py)."""
    pid = int(os.environ.get(SWEEP_PID_ENV) or 0)
    if not pid or not hasattr(os, "pidfd_open"):
        return
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone already
        os.kill(os.getpid(), signal.SIGKILL)

    def wait() -> None:
        select.select([fd], [], [])  # readable once the process has exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="die-with-sweep", daemon=True).start()


class Stop:
    """The parent's handlers while jobs run: the first signal stops the sweep (its jobs are told), a second Ctrl-C
    interrupts at once."""

    def __init__(self) -> None:
        self.signum = 0
        self.previous: dict[int, Any] = {}

    def __enter__(self) -> Stop:
        self.previous = {s: signal.signal(s, self._on_signal) for s in SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signum = self.signum or signum


@contextmanager
def job_env(slot: int, plan: dict[str, list], pin: bool) -> Iterator[None]:
    """What a job started now inherits: its slot, the sweep's pid, its thread count and (`pin`) its cores, and SIGINT
    ignored (a terminal's Ctrl-C reaches the whole process group; submitit's job controller would kill its job on
    it)."""
    saved = {k: os.environ.get(k) for k in (SLOT_ENV, SWEEP_PID_ENV, "OMP_NUM_THREADS")}
    cpus = plan["cpus"]
    os.environ[SLOT_ENV] = f"{slot}:{','.join(map(str, cpus)) if pin else ''}"
    os.environ[SWEEP_PID_ENV] = str(os.getpid())
    if cpus:
        threads = min(len(cpus), int(saved["OMP_NUM_THREADS"] or len(cpus)))
        os.environ["OMP_NUM_THREADS"] = str(threads)
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def launch(launcher: Any, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
    import submitit
    from hydra.core.singleton import Singleton
    from hydra.core.utils import filter_overrides

    try:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count()))
        plans = plan_slots(launcher.slots, launcher.devices, visible_gpus(launcher.accelerator), cpus)
    except ConfigError as err:
        exit_with(err)
    sweep_dir = Path(str(launcher.config.hydra.sweep.dir))
    sweep_dir.mkdir(parents=True, exist_ok=True)
    executor = submitit.LocalExecutor(folder=launcher.params["submitit_folder"], max_num_timeout=0)
    keep = ("timeout_min", "signal_delay_s", "setup")  # one task a job: the job starts its own ranks (jobs.py)
    executor.update_parameters(**{k: v for k, v in launcher.params.items() if k in keep and v is not None})
    where = [describe(p) for p in plans]
    log.info(
        "parallel sweep: %d jobs on %d slots (%s) in %s",
        len(job_overrides),
        len(plans),
        "; ".join(where),
        sweep_dir,
    )

    queue = deque(enumerate(job_overrides, initial_job_idx))
    free, running, results, told = list(range(len(plans))), {}, {}, False
    with Stop() as stop:
        while queue or running:
            while queue and free and not stop.signum:
                slot, (idx, overrides) = free.pop(0), queue.popleft()
                gpus = [int(g) for g in plans[slot]["gpus"]]
                executor.update_parameters(gpus_per_node=len(gpus), visible_gpus=gpus)
                with job_env(slot, plans[slot], launcher.pin_cores):
                    args = (list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state())
                    job = executor.submit(launcher, *args)
                log.info("job %d on slot %d (%s): %s", idx, slot, where[slot], " ".join(filter_overrides(overrides)))
                running[idx] = (job, slot, list(overrides))
            if stop.signum and not told:  # jobs not started stay so; resume=auto starts them
                name = signal.Signals(stop.signum).name
                log.warning("%s: stopping %d running jobs, %d not started", name, len(running), len(queue))
                queue.clear()
                told = True
                for job, _, _ in running.values():  # a local job's id is its controller's pid
                    with suppress(ProcessLookupError):
                        os.kill(int(job.job_id), signal.SIGTERM)  # the controller forwards it to its job
            for idx, (job, slot, overrides) in list(running.items()):
                if job.done():
                    results[idx] = job_result(launcher, job, idx, overrides, sweep_dir)
                    free.append(slot)
                    del running[idx]
            time.sleep(0.2)
    if stop.signum:
        stopped(launcher, stop.signum, len(results), len(job_overrides))
    return [results[i] for i in sorted(results)]


def job_result(launcher: Any, job: Any, idx: int, overrides: list[str], sweep_dir: Path) -> Any:
    """The job's JobReturn. A job that failed is logged and the sweep goes on: the job recorded its own failure
    (`failed` in its result.json), or its process died without one (the summary lists it as missing); one a signal
    stopped said so in its result.json."""
    from hydra.core.utils import JobReturn, JobStatus
    from submitit.core.utils import UncompletedJobError

    result = sweep_dir / str(idx) / "result.json"
    try:
        ret = job.results()[0]
        _ = ret.return_value  # a job that raised: Hydra's FAILED status raises it here
        done = json.loads(result.read_text()) if result.is_file() else {"status": "done"}
        if done["status"] == "failed":  # recorded by the job itself (jobs.py): the sweep goes on
            log.error("job %d failed: %s", idx, done.get("reason"))
        else:
            log.info("job %d finished: %s", idx, done["status"])
        return ret
    except UncompletedJobError:  # its process ended without a result: a signal (75), a user's mistake (2), a kill
        lines = job.paths.stderr.read_text().splitlines() if job.paths.stderr.is_file() else []
        said = next((line for line in reversed(lines) if line.startswith(("error: ", "preempted: "))), "no result")
    except Exception as err:
        said = f"{type(err).__name__}: {err}"
    if said.startswith("preempted: "):
        log.info("job %d stopped: %s", idx, said)
    else:
        log.error("job %d failed (%s); its log: %s", idx, said, job.paths.stderr)
    value = float("nan") if launcher.config.get("optimized_metric") else None
    return JobReturn(overrides=overrides, status=JobStatus.COMPLETED, _return_value=value)


def stopped(launcher: Any, signum: int, done: int, total: int) -> None:
    """After a signal: the summary of the jobs so far (Hydra's end-of-multirun callbacks), one line, exit 75."""
    from hydra.utils import instantiate

    for node in reversed(list((launcher.config.hydra.get("callbacks") or {}).values())):
        instantiate(node).on_multirun_end(config=launcher.config)
    print(
        f"preempted: {signal.Signals(signum).name} stopped the parallel sweep ({done} of {total} jobs stopped or "
        "done); rerun the same command with resume=auto to continue it",
        file=sys.stderr,
        flush=True,
    )
    sys.exit(PREEMPTED_EXIT)
