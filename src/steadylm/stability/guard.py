"""`NonFiniteGuard`: a non-finite loss or gradient on any rank skips the optimizer step on all ranks.

The decision comes from the probe's all-reduced flag, before clipping and the update. A skip leaves
weights, moments, step count and weight decay untouched (on the device through fused AdamW's `found_inf`
when deferred, else by setting every `.grad` to None; zeroing grads would not do: AdamW would still decay
and move), and the LR schedule does not advance. Deferred, the counting, events, rollback and stop come
one step after the bad step (see `probe`); the events still name the bad step. After
`max_consecutive` skips in a row it asks `Recovery` to roll back to the last good snapshot (escalating and
bounded there), or stops every rank together, keeping the last good state beside the broken one.
The first non-finite module is named only from what was observed: a re-run of the bad batch with hooks
on the rank that saw it (the first non-finite output in forward order), else the one parameter whose
gradient was non-finite; when the re-run is finite and many gradients were bad, the event says
"transient: not reproduced on re-run" and names no module. A stop writes a forensic bundle. It must never raise on one rank: a raise while the others wait in a
collective is a hang.
Under fp16 a non-finite gradient with a finite loss is the loss scaler's business (it skips the step
and lowers the scale; `LossScaleMonitor` counts and alarms); the guard acts on a non-finite loss.
"""

from __future__ import annotations

import lightning as L

from steadylm.errors import ConfigError
from steadylm.stability.events import emit
from steadylm.stability.forensics import name_culprit, write_bundle
from steadylm.stability.probe import ProbeUser, loss_scaler
from steadylm.stability.suspects import batch_window_ids

ACTIONS = ("rollback", "stop")


class NonFiniteGuard(ProbeUser, L.Callback):
    def __init__(self, max_consecutive: int = 3, action: str = "rollback", defer: bool = True) -> None:
        if action not in ACTIONS:
            raise ConfigError(f"callbacks.guard.action={action!r} is not one of {', '.join(ACTIONS)}")
        if not isinstance(defer, bool):
            raise ConfigError(f"callbacks.guard.defer={defer!r} must be true or false")
        if max_consecutive < 1:
            raise ConfigError(f"callbacks.guard.max_consecutive={max_consecutive} must be >= 1")
        self.max_consecutive = int(max_consecutive)
        self.action = action
        self.defer = defer  # False: read every step's value on the host at the step itself (one sync per step)
        self.consecutive = 0
        self.streak_start = -1
        self.module: str | None = None  # first non-finite module of the current streak
        self.evidence: str | None = None  # how it was named (or why none was)

    def observe(self, trainer, pl_module, optimizer, m) -> None:
        scaler_owns_it = loss_scaler(trainer) is not None and not m.loss_nonfinite
        if not m.nonfinite or scaler_owns_it:
            self.consecutive = 0
            return
        probe = self.suite.probe
        probe.skip(trainer, pl_module, m)  # deferred: the device skipped it already; this counts it
        self.suite.suspect_steps.add(m.step)
        if self.consecutive == 0:
            self.streak_start = m.step
            self.module, self.evidence, _ = name_culprit(trainer, pl_module, m)
        self.consecutive += 1
        kind = "nonfinite_loss" if m.loss_nonfinite else "nonfinite_grad"
        detail = {
            "module": self.module,
            "evidence": self.evidence,
            "value": m.loss if m.loss_nonfinite else m.grad_norm,
            "consecutive": self.consecutive,
            "batch": [batch_window_ids(trainer, i) for i in m.batch_idx],
        }
        if self.consecutive < self.max_consecutive:
            emit(trainer, m.step, kind, "skip", detail)
            return
        recovery = self.suite.recovery
        if self.action == "rollback" and optimizer is not None:
            restored = recovery.rollback(trainer, pl_module, optimizer, self.streak_start)
            if restored is not None:
                self.consecutive = 0
                emit(trainer, m.step, kind, "rollback", detail)
                emit(
                    trainer,
                    m.step,
                    "rollback",
                    "rollback",
                    {**restored, "module": self.module, "from_step": self.streak_start},
                )
                return
        self._stop(trainer, pl_module, m, kind, detail)

    def _stop(self, trainer, pl_module, m, kind: str, detail: dict) -> None:
        module, evidence, report = name_culprit(trainer, pl_module, m)
        bundle = {
            "step": m.step,
            "streak_start": self.streak_start,
            "kind": kind,
            "module": module or self.module,
            "evidence": evidence,
            "first_module": self.module,
            "batch": detail["batch"],
            "rank": trainer.global_rank,
            **report,
        }
        path = write_bundle(trainer, m.step, bundle)
        emit(trainer, m.step, kind, "stop", detail)
        recovery = self.suite.recovery
        why = (
            "callbacks.guard.action=stop"
            if self.action == "stop"
            else "the rollback budget is spent"
            if recovery.rollbacks >= recovery.max_rollbacks
            else "there is no good snapshot or checkpoint to roll back to"
        )
        reason = f"{self.consecutive} non-finite steps in a row from step {self.streak_start}; {why}"
        recovery.stop(
            trainer,
            pl_module,
            m.step,
            kind,
            reason,
            {
                "module": self.module or module,
                "consecutive": self.consecutive,
                "forensics": str(path) if path else None,
            },
        )

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "streak_start": self.streak_start}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive = int(state["consecutive"])
        self.streak_start = int(state["streak_start"])
