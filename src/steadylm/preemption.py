"""Preemption (docs/resume.md): a signal stops every rank at the same optimizer-step boundary with
`checkpoints/preempted.ckpt` (never one rank alone: the others would hang in a collective); `steadylm.requeue` ends
the process."""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.exceptions import SIGTERMException

from steadylm.errors import ConfigError

log = logging.getLogger("steadylm")


def submitit_signal(env: dict[str, str]) -> int | None:
    """The signal submitit sends this job before its time limit (None outside a submitit job)."""
    names = [env.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")]
    return signal_numbers(names, "SUBMITIT_PREEMPT_SIGNAL")[0] if env.get("SUBMITIT_EXECUTOR") else None


def signal_numbers(names: list[str] | tuple[str, ...], key: str) -> list[int]:
    """`["SIGTERM", "USR1"]` -> signal numbers; an unknown name is the user's mistake, named in one line."""
    full = {name: "SIG" + str(name).upper().removeprefix("SIG") for name in names}
    for name, sig in full.items():
        if sig not in signal.Signals.__members__ or sig in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"{key} has {name!r}, which is not a signal that can be caught; use e.g. SIGTERM")
    return [int(signal.Signals[full[name]]) for name in names]


class Preempted(Exception):
    """Ends `trainer.fit` on every rank at one step, the state saved (so SaveOnException leaves it alone)."""


class CollectiveFlag:
    """The largest signal number any rank has received, agreed by every rank: each poll starts an async all-reduce
    (max) on a host-side gloo group and returns the previous poll's, finished by then (a step of DDP's collectives
    lies between): one poll late but the same on every rank, with no stall on the slowest rank, no device sync."""

    def __init__(self) -> None:
        self.group = self._work = self._buffer = None  # no group with one process: the local flag is the answer

    def setup(self) -> None:  # collective
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
        """Finish the all-reduce in flight (every rank has one at the same polls): its result."""
        if self._work is None:
            return 0
        self._work.wait()
        self._work = None
        return int(self._buffer.item())


class Preemption(L.Callback):
    """Last of the callbacks (`place_last`, even with `callbacks=none`), it saves in `on_train_batch_end` after their
    step bookkeeping and raises `Preempted` as the next batch starts, after Lightning logged the step: not
    `should_stop`, whose validation and end-of-epoch last.ckpt resume=auto would prefer. Its handlers replace
    Lightning's (a mid-loop `SIGTERMException`) from `on_train_start`. Its batch-end hook is armed by the first
    signal, or for the whole fit where ranks must agree (DDP): a quiet single-process step calls nothing here."""

    def __init__(
        self,
        dirpath: str,
        filename: str = "preempted.ckpt",
        signals: tuple[str, ...] = ("SIGTERM", "SIGINT", "SIGUSR1"),
        requeue_signals: tuple[str, ...] = ("SIGUSR1",),
        every_n_steps: int = 1,
    ):
        if int(every_n_steps) < 1:
            raise ConfigError(f"callbacks.preemption.every_n_steps={every_n_steps} must be >= 1")
        self.path = Path(dirpath) / filename
        self.signals = signal_numbers(signals, "callbacks.preemption.signals")
        self.submitit = submitit_signal(dict(os.environ))
        if self.submitit not in (None, *self.signals):
            self.signals.append(self.submitit)
        self.requeue_signals = signal_numbers(requeue_signals, "callbacks.preemption.requeue_signals")
        self.every_n_steps = int(every_n_steps)
        self.flag = CollectiveFlag()
        self.received = 0  # the first signal this process received (0: none)
        self.record: dict | None = None  # set on every rank when the run stopped for a signal
        self.previous: dict = {}  # the handlers ours replaced (submitit's requeue among them)

    def _on_signal(self, signum: int, frame) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: the user does not want to wait for the step
        if not self.received:
            self.received = signum
            log.warning("%s received: stopping at the next step boundary", signal.Signals(signum).name)
            if "on_train_batch_end" not in self.__dict__:  # one process: polled from now on, at the next boundary
                self._last_step = self._trainer.global_step
                self.on_train_batch_end = self._poll

    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage == "fit":
            self.flag.setup()
            if self.flag.group is not None:  # every rank polls every step: the signal may reach one rank only
                self.on_train_batch_end = self._poll

    def on_train_start(self, trainer, pl_module) -> None:
        self._last_step, self._trainer = trainer.global_step, trainer
        self.previous = {signum: signal.signal(signum, self._on_signal) for signum in self.signals}

    def _poll(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if step == self._last_step or step % self.every_n_steps:
            return  # inside gradient accumulation (not a step boundary), or not a polling step
        self._last_step = step
        agreed = self.flag.poll(self.received)
        if agreed:  # collective: every rank is at this step
            trainer.save_checkpoint(self.path, weights_only=False)
            name, path = signal.Signals(agreed).name, str(self.path)
            self.record = {"signal": name, "step": step, "checkpoint": path, "requeue": self.requeuer(agreed)}
            if not 0 <= trainer.max_steps <= step:  # no scheduled validation on the way out (the grace is short)
                trainer.limit_val_batches = 0
            self.on_train_batch_start = self._stop

    def _stop(self, trainer, pl_module, batch, batch_idx) -> None:
        self.flag.wait()
        raise Preempted

    def on_train_end(self, trainer, pl_module) -> None:
        self.flag.wait()  # leave no all-reduce in flight
        self.record = None  # the signal came at the last step: the run finished all the same
        self.__dict__.pop("on_train_batch_start", None)
        self.__dict__.pop("on_train_batch_end", None)

    def requeuer(self, signum: int) -> str | None:
        """Who requeues the job: `submitit` (its own signal), `scontrol` (a pre-timeout signal), None (nobody)."""
        return "submitit" if signum == self.submitit else "scontrol" if signum in self.requeue_signals else None

    def on_exception(self, trainer, pl_module, exception) -> None:
        if isinstance(exception, SIGTERMException):  # Lightning's handler, before ours: no new checkpoint
            self.record = {"signal": "SIGTERM", "step": trainer.global_step, "checkpoint": None, "requeue": None}


def place_last(callbacks: list, dirpath: str | os.PathLike) -> list:
    """`callbacks` with the one `Preemption` last (a default one when the config has none: a signal always exits 75)."""
    found = [c for c in callbacks if isinstance(c, Preemption)] or [Preemption(dirpath=str(dirpath))]
    return [c for c in callbacks if not isinstance(c, Preemption)] + found[-1:]
