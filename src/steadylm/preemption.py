"""Preemption: a signal ends the run at a step boundary, checkpointed, with exit code 75 and a record.

Clusters stop jobs with a signal (SLURM: SIGTERM, and SIGUSR1 before the time limit with
`--signal=USR1@90`; Kubernetes: SIGTERM; a person: Ctrl-C). `Preemption` replaces Lightning's handlers
for those signals while training runs: the handler only notes the signal, and at the next optimizer-step
boundary every rank agrees (one all-reduced flag) to save `checkpoints/preempted.ckpt` and stop together.
`finish_preempted` then writes `result.json` (`status: preempted`), prints one line with the command that
resumes, asks SLURM to requeue the job after the pre-timeout signal, and exits with `PREEMPTED_EXIT`.

Exit code 75 is `EX_TEMPFAIL` from sysexits.h ("temporary failure; the user is invited to retry"): it is
neither failure (1), bad input (2) nor divergence (3), nor 128+N (killed by a signal, no state saved), and
schedulers can act on it (SLURM's `RequeueExit=75`, a Kubernetes `podFailurePolicy` on exit code 75).

Under the submitit launcher (`hydra/launcher=slurm`), submitit's own pre-timeout signal (SIGUSR2, or
`$SUBMITIT_PREEMPT_SIGNAL`) joins the signals: the step-boundary checkpoint comes first, then the run hands
the signal to submitit's handler, which requeues the job (SLURM: `scontrol requeue`; the local executor:
a restart); `resolve_ckpt_path` lets the requeued job continue from its own checkpoints by itself.

This module must never stop one rank alone: a rank leaving while the others wait in a collective hangs them.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from omegaconf import OmegaConf

from steadylm.distributed import in_multirun, is_rank_zero_process
from steadylm.errors import ConfigError

log = logging.getLogger("steadylm")

PREEMPTED_EXIT = 75  # EX_TEMPFAIL (see the module docstring)
CHECKPOINT_NAME = "preempted.ckpt"


def submitit_signal(env: dict[str, str]) -> int | None:
    """The signal submitit sends this job before its time limit (None outside a submitit job)."""
    if not env.get("SUBMITIT_EXECUTOR"):
        return None
    return int(getattr(signal, "SIG" + env.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").upper().removeprefix("SIG")))


def signal_numbers(names: list[str] | tuple[str, ...], key: str) -> list[int]:
    """`["SIGTERM", "USR1"]` -> signal numbers; an unknown name is the user's mistake, named in one line."""
    numbers = []
    for name in names:
        full = str(name).upper() if str(name).upper().startswith("SIG") else f"SIG{str(name).upper()}"
        if not isinstance(getattr(signal, full, None), signal.Signals) or full in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"{key} has {name!r}, which is not a signal that can be caught; use e.g. SIGTERM")
        numbers.append(int(getattr(signal, full)))
    return numbers


class Preempted(Exception):
    """Ends `trainer.fit` on every rank at the same step once the checkpoint is written; `train` catches it."""

    state_saved = True  # SaveOnException leaves it alone: the state is already on disk

    def __init__(self, record: dict[str, Any]):
        super().__init__(f"{record['signal']} at step {record['step']}")
        self.record = record


class CollectiveFlag:
    """The largest signal number any rank has received, agreed by every rank.

    Each poll starts an all-reduce (max) of the local flag on a host-side gloo group and returns the
    result of the previous poll's all-reduce, which has finished by then (a step of DDP's own collectives
    lies between): the decision is one poll late but identical on every rank, the host does not stall on
    the slowest rank, and the flag never touches a GPU stream (no device sync). With one process the
    local flag is the answer at once.
    """

    def __init__(self) -> None:
        self.group = None
        self._work = None
        self._buffer: torch.Tensor | None = None

    def setup(self) -> None:
        """Collective (every rank calls it): the group the flag travels on."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            self.group = dist.new_group(backend="gloo")

    def poll(self, local: int) -> int:
        if self.group is None:
            return local
        agreed = self.wait()
        self._buffer = torch.tensor([local], dtype=torch.int32)
        self._work = dist.all_reduce(self._buffer, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return agreed

    def wait(self) -> int:
        """Finish the all-reduce in flight (every rank has one at the same polls) and return its result."""
        if self._work is None:
            return 0
        self._work.wait()
        self._work = None
        return int(self._buffer.item())


class Preemption(L.Callback):
    """Stop every rank at one optimizer-step boundary after SIGTERM/SIGINT/SIGUSR1, with a checkpoint.

    `build_trainer` puts it after every other callback (so the checkpoint holds their state after the
    step, as `ModelCheckpoint` would) and adds one with these defaults when the config has none, so
    `callbacks=none` still ends with exit 75. It saves at the step boundary and raises `Preempted` as the
    next batch starts, after Lightning has logged the step. Handlers are installed at `on_train_start`,
    after Lightning registered its own (which would raise `SIGTERMException` mid-loop and exit 0), and
    Lightning's teardown puts the previous handlers back. A second Ctrl-C interrupts at once.
    """

    def __init__(
        self,
        dirpath: str,
        filename: str = CHECKPOINT_NAME,
        signals: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGUSR1"),
        requeue_signals: tuple[str, ...] = ("SIGUSR1",),
        every_n_steps: int = 1,
    ):
        if int(every_n_steps) < 1:
            raise ConfigError(f"callbacks.preemption.every_n_steps={every_n_steps} must be >= 1")
        self.path = Path(dirpath) / filename
        self.signals = signal_numbers(signals, "callbacks.preemption.signals")
        self.submitit = submitit_signal(dict(os.environ))  # submitit's requeue signal, caught too
        if self.submitit is not None and self.submitit not in self.signals:
            self.signals.append(self.submitit)
        self.requeue_signals = signal_numbers(requeue_signals, "callbacks.preemption.requeue_signals")
        self.every_n_steps = int(every_n_steps)
        self.flag = CollectiveFlag()
        self.received = 0  # the first signal this process received (0: none)
        self.record: dict[str, Any] | None = None  # set on every rank when the run stopped for a signal
        self.previous: dict[int, Any] = {}  # the handlers ours replaced (submitit's requeue among them)
        self._last_step = -1

    def _on_signal(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the step
        if not self.received:
            self.received = signum
            log.warning("%s received: stopping at the next step boundary", signal.Signals(signum).name)

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self.flag.setup()

    def on_train_start(self, trainer, pl_module) -> None:
        self._last_step = trainer.global_step
        self.previous = {signum: signal.signal(signum, self._on_signal) for signum in self.signals}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step or step % self.every_n_steps:
            return  # inside gradient accumulation (not a step boundary), or not a polling step
        self._last_step = step
        agreed = self.flag.poll(self.received)
        if agreed:
            # Here, like ModelCheckpoint's step saves, after every other callback's step bookkeeping: the
            # exact state to resume from. Collective: every rank is at this step.
            trainer.save_checkpoint(self.path, weights_only=False)
            self.record = {
                "signal": signal.Signals(agreed).name,
                "step": step,
                "checkpoint": str(self.path),
                "requeue": self.requeuer(agreed),  # who asks the cluster to requeue the job, if anyone
            }
            if not 0 <= trainer.max_steps <= step:  # no scheduled validation on the way out (the grace period is short)
                trainer.limit_val_batches = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.record is not None:
            # An exception, not `should_stop`: a stop through the loop's end would run Lightning's
            # early-stopping validation and let ModelCheckpoint write last.ckpt with an end-of-epoch loop
            # state, which resume=auto would then prefer (newer) and resume inexactly from.
            self.flag.wait()
            raise Preempted(self.record)

    def on_train_end(self, trainer, pl_module) -> None:
        self.flag.wait()  # leave no all-reduce in flight
        self.record = None  # the signal came at the last step: the run finished all the same

    def requeuer(self, signum: int) -> str | None:
        """`submitit` for submitit's own signal (its handler requeues), `scontrol` for a pre-timeout signal
        under plain SLURM (`requeue`), None for a signal that only stops the run."""
        if signum == self.submitit:
            return "submitit"
        return "scontrol" if signum in self.requeue_signals else None

    def hand_over(self) -> None:
        """After the checkpoint and result.json: give submitit's signal to the handler it installed, which
        requeues the job and exits (its rank 0; on the other ranks it returns). Submitit refusing to
        requeue (too many timeouts) is reported, and the run still exits 75."""
        handler = self.previous.get(self.submitit)
        if self.record and self.record["requeue"] == "submitit" and callable(handler):
            try:
                handler(self.submitit, None)
            except Exception as err:
                log.error("submitit did not requeue the job: %s", err)

    def stopped_by_lightning(self, trainer) -> None:
        """Lightning's own SIGTERM handler ended the run (the signal came before `on_train_start`, or is not
        in `signals`): its `SIGTERMException` left no step-boundary checkpoint, but the run is still preempted."""
        self.record = {"signal": "SIGTERM", "step": trainer.global_step, "checkpoint": None, "requeue": None}


def preemption_callback(trainer) -> Preemption:
    """The trainer's `Preemption` (`place_last` made sure there is one)."""
    return next(c for c in trainer.callbacks if isinstance(c, Preemption))


def preemption_of(trainer) -> dict[str, Any] | None:
    """What `Preemption` recorded when this run stopped for a signal; None when it did not."""
    return preemption_callback(trainer).record


def place_last(callbacks: list, dirpath: str | os.PathLike) -> list:
    """`callbacks` with the one `Preemption` last (a default one when the config has none)."""
    found = [c for c in callbacks if isinstance(c, Preemption)] or [Preemption(dirpath=str(dirpath))]
    return [c for c in callbacks if not isinstance(c, Preemption)] + found[-1:]


def resume_command(output_dir: str, overrides: list[str], script: str) -> str:
    """The command that continues this run: the same overrides, the same run dir, `resume=auto`."""
    kept = [o for o in overrides if o.split("=", 1)[0].lstrip("+~") not in ("resume", "ckpt_path", "hydra.run.dir")]
    return shlex.join(["python", script, *kept, f"hydra.run.dir={output_dir}", "resume=auto"])


def slurm_requeue_command(env: dict[str, str]) -> list[str] | None:
    """`scontrol requeue <job>` for this SLURM job (array tasks as JOB_TASK); None outside SLURM."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return ["scontrol", "requeue", f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"]
    if env.get("SLURM_JOB_ID"):
        return ["scontrol", "requeue", env["SLURM_JOB_ID"]]
    return None


def requeue(record: dict[str, Any], env: dict[str, str]) -> str:
    """Ask SLURM to requeue this job when the signal was a pre-timeout one; a note for the user's line."""
    if record["requeue"] == "submitit":
        return "; submitit requeues the job, and it resumes by itself"
    command = slurm_requeue_command(env) if record["requeue"] == "scontrol" else None
    if command is None:
        return ""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"; `{shlex.join(command)}` failed ({err}): resubmit the job yourself"
    if done.returncode:
        return f"; `{shlex.join(command)}` failed ({done.stderr.strip() or done.returncode}): resubmit it yourself"
    return f"; requeued SLURM job {command[-1]} (it resumes by itself with resume=auto)"


def end_multirun() -> None:
    """Call `on_multirun_end` of the multirun's `hydra.callbacks` (the sweep summary among them), as Hydra does
    after its last job: a signal ends the multirun inside a job, and Hydra never gets there."""
    config = OmegaConf.create({"hydra": OmegaConf.to_container(HydraConfig.get(), resolve=True)})
    for node in reversed(list((config.hydra.get("callbacks") or {}).values())):  # Hydra's order at the end
        instantiate(node).on_multirun_end(config=config)


def finish_preempted(cfg, preemption: Preemption) -> None:
    """The end of a preempted run (result.json already written): one line, the requeue, exit 75.

    In a multirun the process ends too (the signal was for it), after the multirun's end callbacks have
    summarised the jobs run so far; a submitit job is one job of the sweep, which its submitting process
    summarises."""
    record = preemption.record
    if is_rank_zero_process():
        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        script = "train.py" if record["requeue"] == "submitit" else sys.argv[0] or "train.py"  # not submitit's
        command = resume_command(str(cfg.paths.output_dir), overrides, script)
        saved = f"state saved in {record['checkpoint']}" if record["checkpoint"] else "no new checkpoint"
        note = requeue(record, dict(os.environ))
        print(
            f"preempted: {record['signal']} at step {record['step']}, {saved}; resume with: {command}{note}",
            file=sys.stderr,
            flush=True,
        )
        if in_multirun() and record["requeue"] != "submitit":
            end_multirun()
    preemption.hand_over()
    sys.exit(PREEMPTED_EXIT)
