"""A sweep job on N processes is owned by its own process (`steadylm.jobs`): the job's ranks run under torch's elastic
launcher; a user's mistake, an exception or a kill on any rank is that job's `failed` row, with the first failing
rank's own error, and the next job runs; a SIGKILL of the sweep leaves no rank running, and `resume=auto` refuses a
job folder another live process holds."""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import lightning as L
import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from steadylm.errors import ConfigError, exit_with
from steadylm.jobs import LOCK_FILE, first_failure, lock_job
from tests.helpers import CLI_TINY, ROOT, cli_env, cli_steps, run_cli
from tests.test_preemption import processes_running

GLOO_PEER_LOST = (
    "RuntimeError: [../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:13965. This is "
    "typically caused by a remote worker crashing. Check the logs of the remote worker before reporting an error."
)


class Fault(L.Callback):
    """On global rank `rank` of sweep job number i, at optimizer step `step`: `actions[i]` (`raise` an exception,
    `kill` its own process with SIGKILL, anything else: nothing)."""

    def __init__(self, actions: list[str], rank: int = 1, step: int = 2):
        self.actions, self.rank, self.step = list(actions), int(rank), int(step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        action = self.actions[int(Path(trainer.default_root_dir).name)]
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if action == "raise":
            raise RuntimeError(f"injected fault on rank {self.rank} at step {self.step}")
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)


class RankPid(L.Callback):
    """Each rank writes `rank<k>.pid` into its run dir; `sleep` seconds a step, and `training` once a step ran."""

    def __init__(self, sleep: float = 0.0):
        self.sleep = float(sleep)

    def on_fit_start(self, trainer, pl_module):
        Path(trainer.default_root_dir, f"rank{trainer.global_rank}.pid").write_text(str(os.getpid()))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.sleep)
        Path(trainer.default_root_dir, "training").touch()


def failure(tmp_path: Path, rank: int, exitcode: int, message: str | None, timestamp: int = 100) -> ProcessFailure:
    """A rank's failure as torch's elastic launcher reads it back (its error file, when it wrote one)."""
    path = tmp_path / f"error{len(list(tmp_path.iterdir()))}.json"  # a file of its own
    if message is not None:
        path.write_text(json.dumps({"message": message, "timestamp": timestamp}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(path))


def test_the_first_failure_is_the_rank_that_failed_not_the_ones_it_took_down(tmp_path):
    """Every rank but the failing one ends with "connection closed by peer" or the launcher's SIGTERM, often in the
    same second: the cause decides before the time, the time before the rank."""
    raised = failure(tmp_path, 1, 1, "RuntimeError: injected fault on rank 1")
    assert first_failure({0: failure(tmp_path, 0, 1, GLOO_PEER_LOST), 1: raised}) == (
        1,
        "RuntimeError: injected fault on rank 1",
    )
    killed = failure(tmp_path, 1, -9, None, timestamp=101)
    assert first_failure({0: failure(tmp_path, 0, -15, GLOO_PEER_LOST), 1: killed}) == (1, "killed by SIGKILL")
    stopped = failure(tmp_path, 0, -15, None)  # stopped by the launcher before it ever saw the peer go
    assert first_failure({0: stopped, 1: killed}) == (1, "killed by SIGKILL")
    both = {r: failure(tmp_path, r, 2, f"error: bad value ({r})", timestamp=100 + r) for r in (1, 0)}
    assert first_failure(both) == (0, "error: bad value (0)")  # the same mistake on every rank: the earliest


def test_a_users_mistake_on_a_rank_reaches_the_launcher_as_its_line(tmp_path, monkeypatch):
    """`exit_with` under torch's elastic launcher also writes the line to the rank's error file, which the launcher
    reads as the failure's message (not "To enable traceback see ...")."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error1.json"))
    with pytest.raises(SystemExit) as ended:
        exit_with(ConfigError("model.n_head=3 does not divide model.d_model=32"))
    assert ended.value.code == 2
    read = ProcessFailure(local_rank=1, pid=1, exitcode=2, error_file=str(tmp_path / "error1.json"))
    assert first_failure({1: read}) == (1, "error: model.n_head=3 does not divide model.d_model=32")


def test_a_job_folder_is_held_by_one_process_at_a_time(tmp_path):
    held = lock_job(tmp_path / "0")
    try:
        assert (tmp_path / "0" / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        with pytest.raises(ConfigError, match=f"{tmp_path / '0'} is being written by process {os.getpid()} "):
            lock_job(tmp_path / "0")
    finally:
        os.close(held)
    os.close(lock_job(tmp_path / "0"))  # released with its holder


@pytest.mark.slow
def test_a_bad_value_an_exception_or_a_kill_on_one_rank_is_that_jobs_failed_row(shards_dir, tmp_path):
    """Four 2-process jobs: job 0's `model.n_head=3` is a user's mistake (one line, on both ranks); rank 1 of job 1
    raises at step 2; rank 1 of job 2 is SIGKILLed at step 2; job 3 trains. Each of 0-2 is `failed` with the first
    failing rank's own error (not rank 0's "connection closed"), ends within seconds, and the next job runs; job 3's
    ranks ran job 3 in its folder, one writer; no rank is left running."""
    fault = "+callbacks.fault={_target_: test_jobs.Fault, actions: [none, raise, kill, none]}"
    probe = "+callbacks.pid={_target_: test_jobs.RankPid}"
    args = ["-m", "trainer=ddp_sim", f"data.dir={shards_dir}", *CLI_TINY, "model.n_head=3,2,2,2", fault, probe]
    proc = run_cli(*args, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in (tmp_path / "logs" / "train").iterdir()] == ["multiruns"]  # no rank made a run of its own
    sweep = next((tmp_path / "logs" / "train" / "multiruns").iterdir())
    assert f"sweep summary: {sweep / 'summary.md'} (4 jobs, 0 unstable, 0 diverged, 3 failed)" in proc.stdout
    results = [json.loads((sweep / str(i) / "result.json").read_text()) for i in range(4)]
    assert [r["status"] for r in results] == ["failed", "failed", "failed", "ok"]
    reasons = [r["reason"] for r in results[:3]]
    assert re.match(r"rank [01]: error: model.d_model=32 is not divisible by model.n_head=3;", reasons[0])  # both
    assert reasons[1] == "rank 1: RuntimeError: injected fault on rank 1 at step 2"
    assert reasons[2] == "rank 1: killed by SIGKILL"
    for job in (1, 2):  # each ended as soon as the launcher saw it (its other rank stopped within 30 s)
        started = (sweep / str(job) / ".hydra" / "config.yaml").stat().st_mtime
        assert (sweep / str(job) / "result.json").stat().st_mtime - started < 60
    assert all(f"job failed: {sweep / str(i)}: {reasons[i]}" in proc.stderr for i in range(3))
    table = (sweep / "summary.md").read_text()
    assert "| failed | rank 1: RuntimeError: injected fault on rank 1 at step 2 |" in table
    assert "| failed | rank 1: killed by SIGKILL |" in table
    good = sweep / "3"
    assert sorted(p.name for p in good.glob("rank*.pid")) == ["rank0.pid", "rank1.pid"]
    assert len(list(good.rglob(".hydra"))) == 1 and len(list(good.rglob("*.log"))) == 1  # rank 0's train.log
    assert len(list(good.rglob("events.out.tfevents.*"))) == 1
    assert math.isfinite(results[3]["val_loss"])
    assert processes_running(str(sweep)) == []


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (killed, not yet reaped by whoever adopted it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


@pytest.mark.slow
def test_a_sigkill_of_the_sweep_leaves_no_rank_running_and_resume_waits_for_the_folder(shards_dir, tmp_path):
    """While job 0 trains on 2 processes: the same sweep with `resume=auto` refuses the folder in one line (exit 2),
    naming the process that writes it; then a SIGKILL of the sweep takes both ranks with it and frees the folder."""
    steps = cli_steps(1000)
    probe = "+callbacks.pid={_target_: test_jobs.RankPid, sleep: 0.2}"  # job 0 trains until it is killed
    args = ["-m", "trainer=ddp_sim", "optim.lr=1e-3,2e-3", f"data.dir={shards_dir}", *steps, probe]
    env = cli_env(tmp_path)
    sweep_root = tmp_path / "logs" / "train" / "multiruns"
    with subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    ) as proc:
        try:
            deadline = time.monotonic() + 240
            while not any(sweep_root.glob("*/0/training")):
                assert proc.poll() is None and time.monotonic() < deadline, "job 0 never trained"
                time.sleep(0.2)
            job = next(sweep_root.glob("*/0"))
            again = run_cli(*args, "resume=auto", cwd=tmp_path, timeout=120)
            assert again.returncode == 2, again.stdout[-2000:] + again.stderr[-2000:]
            assert again.stderr.strip().splitlines()[-1] == (
                f"error: {job} is being written by process {proc.pid} (this sweep, still running); "
                "wait for it or stop it, then rerun with resume=auto"
            )
            assert "Traceback" not in again.stderr and not (job.parent / "1").exists()
            assert proc.poll() is None  # the sweep is still at job 0
        finally:
            proc.kill()
    ranks = [int((job / f"rank{r}.pid").read_text()) for r in (0, 1)]
    assert processes_running(str(job)) == []
    deadline = time.monotonic() + 10  # a killed process takes a moment to exit
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in ranks), [Path(f"/proc/{pid}/status").read_text()[:300] for pid in ranks]
    with open(job / LOCK_FILE) as held:  # free for the next sweep
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
