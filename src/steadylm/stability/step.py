"""`Stability`: the one callback that owns each optimizer step's stability checks (start at `on_before_optimizer_step`).

Every check follows the protocol of `check.py`: it returns `Verdict`s and this class applies them (an LR backoff
through `backoff.act`), so escalation, the rollback budget and the stop live here. Every decision comes from the
one all-reduced measurement, so every rank applies the same verdicts: no rank ever raises or stops alone.
"""

from __future__ import annotations

import importlib
import inspect
import math
from types import MappingProxyType

import lightning as L
from omegaconf import DictConfig, OmegaConf

from steadylm.checkpointing import STABILITY_STATE_KEY
from steadylm.compat import every_n_train_steps
from steadylm.errors import ConfigError, number
from steadylm.logging_steps import write_metrics
from steadylm.stability.check import StepView
from steadylm.stability.events import emit
from steadylm.stability.measure import Measurement, StepMeasure, loss_scaler
from steadylm.stability.recovery import Recovery
from steadylm.stability.verdict import Verdict

NONFINITE = ("nonfinite_loss", "nonfinite_grad")


# The built-in checks, by config key, in the order they are judged: a module is imported only when its node is set.
CHECKS = {
    "guard": "steadylm.stability.guard:NonFiniteGuard",
    "spike": "steadylm.stability.spike:SpikeDetector",
    "loss_scale": "steadylm.stability.loss_scale:LossScaleMonitor",
    "init_loss": "steadylm.stability.init_loss:InitLoss",
    "qk_clip": "steadylm.stability.qk_clip:QKClip",
    "stats": "steadylm.stability.stats:GradParamStats",
    "signals": "steadylm.stability.signals:Precursors",
}
BUILT_IN = (*CHECKS, "recovery", "measure")
DEFAULTS = MappingProxyType({})  # a part not named: built with its own defaults (null removes it)


def _part(name: str, settings, cls=None):
    """A check built from its config node `callbacks.stability.<name>`, or None when the node is null (removed)."""
    if settings is None:
        return None
    if cls is None:
        module, _, attr = CHECKS[name].partition(":")
        cls = getattr(importlib.import_module(module), attr)
    settings = OmegaConf.to_container(settings) if isinstance(settings, DictConfig) else dict(settings)
    known = inspect.signature(cls).parameters
    if unknown := sorted(set(settings) - set(known)):
        raise ConfigError(f"callbacks.stability.{name}.{unknown[0]} is not a setting; use one of {', '.join(known)}")
    for key, value in settings.items():  # text where a number belongs: this line, not a TypeError in the check
        if value is not None and math.isnan(number(value)) and not math.isnan(default := number(known[key].default)):
            raise ConfigError(f"callbacks.stability.{name}.{key}={value!r} must be a number (default {default:g})")
    return cls(**settings)


def _checks_from_config(nodes) -> list:
    """The checks named under `callbacks.stability.checks` (`<name>: {_target_: ...}`, built by Hydra), each
    called `<name>`; one set to null is left out."""
    out = []
    for name, check in (nodes or {}).items():
        if check is None:
            continue
        where = f"callbacks.stability.checks.{name}"
        if name in BUILT_IN:
            raise ConfigError(f"{where}: {name!r} is a built-in part's name; call the check something else")
        if isinstance(check, (dict, DictConfig)):  # Hydra builds every node with a `_target_`
            raise ConfigError(f"{where} has no _target_ (the check's class, e.g. my_package.checks.MyCheck)")
        if not callable(getattr(check, "verdict", None)):
            raise ConfigError(f"{where}: {type(check).__name__} has no verdict(m, view) method (see Check)")
        check.name = name
        out.append(check)
    return out


class Stability(L.Callback):
    """`callbacks.stability`: each part is tunable (`callbacks.stability.spike.sigma=5`) or removable
    (`callbacks.stability.spike=null`); a part not named is built with its defaults, so `Stability()` is the suite
    `train.py` runs; with `recovery=None` a rollback reads the checkpoints on disk."""

    def __init__(self, recovery=DEFAULTS, checks=None, defer: bool = True, **parts):
        if not isinstance(defer, bool):
            raise ConfigError(f"callbacks.stability.defer={defer!r} must be true or false")
        if unknown := sorted(set(parts) - set(CHECKS)):
            raise ConfigError(f"callbacks.stability.{unknown[0]} is not a part; see conf/callbacks/default.yaml")
        for name in CHECKS:  # self.guard, self.spike, ...: None when removed
            setattr(self, name, _part(name, parts.get(name, DEFAULTS)))
        self.recovery = _part("recovery", recovery if recovery is not None else {"every_n_steps": 0}, Recovery)
        # The built-in checks first, then `callbacks.stability.checks` in config order.
        self.checks = [getattr(self, n) for n in CHECKS if getattr(self, n) is not None] + _checks_from_config(checks)
        self._judged: list = self.checks  # those that apply to this fit (`setup`)
        self._hooked: dict[str, list] = {"arm": [], "measure": [], "after_update": []}
        # A check that must act before this step's update (a skip) needs its value at the step: no deferral.
        self.measure = StepMeasure(defer and not any(getattr(c, "acts_before_update", False) for c in self.checks))
        self.stopped = False
        self.in_step = False  # inside `step`: the step under way has not reached the weights
        self._skipped_at = -1  # the last step counted as skipped (several checks may skip the same step)
        self._culprit: tuple[str | None, str] = (None, "")  # the module named at the start of a non-finite streak
        self._log: dict[str, float] | None = None  # this logging step's optimizer metrics, written at batch end
        self._view_now: StepView | None = None  # the step under way, seen at its first micro-batch
        self._save_every: tuple[int, ...] = ()  # the ModelCheckpoints' `every_n_train_steps` (`setup`)
        self._awake: list = []  # the checks this step asks (`Check.next_step`)
        self._scaler = None  # the fp16 GradScaler (`setup`)
        self._token_losses = False  # a judged check reads `view.token_losses` (`setup`)

    state_key = STABILITY_STATE_KEY  # a constant, not Lightning's property (read around every hook call)

    # -- Lightning's hooks ------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        self._scaler = loss_scaler(trainer)
        self._judged = [c for c in self.checks if c.applies(trainer)]
        self._hooked = {hook: [c for c in self._judged if hasattr(c, hook)] for hook in self._hooked}
        self._token_losses = any(getattr(c, "wants_token_losses", False) for c in self._judged)
        if hasattr(pl_module, "keep_token_losses"):
            pl_module.keep_token_losses(self._token_losses)
        if self.signals is not None:  # where QK-clip acts it owns the mitigation; the signals read the stats
            self.signals.qk_clip_acts = self.qk_clip in self._judged
            self.signals.every_n_steps = self.stats.every_n_steps if self.stats in self._judged else None
        # Growth that crosses tau during the LR warmup began near the start: recovery holds the fit's first
        # snapshot until the warmup, and a streak begun at its end, are over; a rewind then goes back to it.
        if any(getattr(c, "backoff", None) is not None and c.backoff.rewind for c in self.checks):
            streaks = [c.streak_steps() for c in self._judged if hasattr(c, "streak_steps")]
            warmup = int(getattr(pl_module, "optim_cfg", {}).get("warmup_steps", 0))
            self.recovery.hold_until = warmup + max(streaks, default=0)
        self._save_every = tuple(n for cb in trainer.checkpoint_callbacks if (n := every_n_train_steps(cb)))

    def _view(self, trainer, pl_module) -> StepView:
        scale = self._scaler.get_scale() if self._scaler is not None else None
        cfg = getattr(getattr(pl_module, "net", None), "cfg", None)
        ms = self.measure
        return StepView(
            trainer.global_step, trainer.world_size, scale, cfg, trainer, pl_module, ms.batches, ms.token_losses
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        ms, step = self.measure, trainer.global_step
        if ms.taken:  # the step's first micro-batch
            ms.batches, ms.batch_idx, ms.losses, ms.token_losses, ms.taken = [], [], [], [], False
            self._view_now = view = self._view(trainer, pl_module)
            # The checks asleep until a later step (`Check.next_step`) cost this step nothing.
            self._awake = [c for c in self._judged if getattr(c, "next_step", 0) <= step]
            for c in self._hooked["arm"]:
                if c in self._awake:
                    c.arm(view)
            if self.recovery.first is not None and step - pl_module.skipped_steps > self.recovery.hold_until:
                self.recovery.release_first()
        ms.batches.append(batch)
        ms.batch_idx.append(batch_idx)
        every = self.recovery.every_n_steps
        if every and step % every == 0:
            self.recovery.maybe_snapshot(trainer, pl_module, self.checks)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.measure.losses.append(loss)
        if self._token_losses:
            self.measure.token_losses.append(pl_module.token_losses)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        """One optimizer step's checks, in order: after backward, before clipping, the LR and the update."""
        self.in_step = True
        try:
            step = trainer.global_step
            if self.recovery.candidate is not None:
                self.recovery.written()  # this step's snapshot has read the weights it copies: they may change now
            view = self._view_now if getattr(self._view_now, "step", -1) == step else self._view(trainer, pl_module)
            measuring = [c for c in self._hooked["measure"] if c in self._awake]
            # The one measurement (deferred: the previous step's), every check's own values in the same collective.
            m = self.measure.take(trainer, pl_module, view, measuring)
            if step < self.recovery.skip_until:  # the data window skipped after a repeated rollback
                self.skip(trainer, pl_module, step)
            if m is not None:
                self.judge(trainer, pl_module, optimizer, m, view)
            if not self.stopped and pl_module.logs_now:
                self._log = self._optimizer_metrics(trainer, pl_module)
        finally:
            self.in_step = False

    def judge(self, trainer, pl_module, optimizer, m: Measurement, view: StepView | None = None) -> None:
        """Every check's verdicts on `m`, in `self.checks` order; the snapshot of `m.step` confirmed or dropped;
        the verdicts applied in the same order (a rollback, a rewind or a stop ends the list: it acted on `m`).
        A check asleep at `m.step` (`Check.next_step`) is asked only when `m` carries its own values."""
        view = view or self._view(trainer, pl_module)
        verdicts, suspect = [], False
        for c in self._judged:
            if getattr(c, "next_step", 0) <= m.step or c.name in m.values:
                v = c.verdict(m, view)
                verdicts += v if isinstance(v, list) else [v]
        for v in verdicts:
            suspect = suspect or v.suspect
            if v.metrics:
                write_metrics(trainer, v.metrics, step=v.onset)
        self.recovery.confirm(m, suspect=suspect)  # known-good snapshot, or dropped
        for v in verdicts:
            if v.action != "ok" and self.apply(trainer, pl_module, optimizer, m, v):
                return

    # -- applying verdicts ------------------------------------------------------------------------------------
    def apply(self, trainer, pl_module, optimizer, m: Measurement, v: Verdict) -> bool:
        """Carry out one verdict and write its event; True when it rolled back or stopped the run."""
        from steadylm.stability import forensics, suspects  # the evidence of an alarm: loaded when one fires

        detail = dict(v.detail)
        if v.kind in NONFINITE:
            if v.context.get("first"):  # every rank: one object all-gather
                self._culprit = forensics.name_culprit(trainer, pl_module, m)[:2]
            module, evidence = self._culprit
            detail.update(module=module, evidence=evidence, batch=suspects.batch_window_ids(trainer, m.batch_idx))
        episode = v.context.get("episode")
        if episode is not None:
            detail["batch"] = suspects.batch_window_ids(trainer, episode["batch_idx"])
        if v.action == "backoff" or v.context.get("temporary"):
            from steadylm.stability.backoff import act  # QK-clip's and the signals' LR backoff: loaded with them

            return act(self, trainer, pl_module, v, detail)
        if v.action == "skip":
            self.skip(trainer, pl_module, m.step)
        elif v.action == "log" and v.context.get("rank"):  # a one-off spike: rank its samples on the good weights
            snap = self.recovery.newest_good(before=v.onset)
            detail.update(suspects.spike_suspects(trainer, pl_module, episode, snap, snap.step if snap else None))
        elif v.action == "rollback":
            self.rollback(trainer, pl_module, optimizer, m, v, detail)
            return True
        elif v.action == "stop":
            self.stop(trainer, pl_module, m.step, v, detail, m=m)
            return True
        if v.kind is not None:
            action = v.context.get("event_action", v.action)
            emit(trainer, v.onset if v.onset is not None else m.step, v.kind, action, detail)
        return False

    def skip(self, trainer, pl_module, step: int) -> None:
        """Step `step` does not count: its update never reaches the weights and the LR does not advance (a step
        late, deferred, the device already skipped it: only the count is left to do)."""
        if step == self._skipped_at:
            return
        self._skipped_at = step
        pl_module.skip_step()
        if step == trainer.global_step:
            self.drop_step(pl_module, abandon=False)

    def rollback(self, trainer, pl_module, optimizer, m: Measurement, v: Verdict, detail: dict) -> None:
        restored = self.recovery.rollback(trainer, pl_module, optimizer, v.onset) if optimizer is not None else None
        if restored is None:
            spent = self.recovery.rollbacks >= self.recovery.max_rollbacks
            why = "the rollback budget is spent" if spent else "there is no good snapshot or checkpoint to roll back to"
            self.stop(trainer, pl_module, m.step, v, detail, why=why, m=m)
            return
        self.continue_from(trainer, pl_module, restored)
        if "lr_backoff" in restored:
            restored["lr_scale"] = pl_module.scale_lr(restored["lr_backoff"])
        episode = v.context.get("episode")
        if episode is not None:  # a persisting spike: re-run its onset batch on the restored weights
            from steadylm.stability.suspects import spike_cause  # loaded when a spike persists

            detail.update(spike_cause(trainer, pl_module, episode, restored["to_step"]))
        emit(trainer, v.onset if episode is not None else m.step, v.kind, "rollback", detail)
        restored.update(cause=v.kind, onset=v.onset, module=detail.get("module"))
        emit(trainer, m.step, "rollback", "rollback", restored)

    def stop(self, trainer, pl_module, step: int, v: Verdict, detail: dict | None, why=None, m=None) -> None:
        """Stop every rank together (all reach it from the same reduced values), keeping the last good state;
        `detail`: the check's event (None: no check detected it); `why`: what made its own remedy impossible."""
        self.stopped = True
        self.drop_step(pl_module)
        reason = f"{v.reason}; {why}" if why else v.reason
        from steadylm.stability import forensics  # what a stop leaves behind: loaded when a run stops

        nonfinite = v.kind in NONFINITE and m is not None
        extra = forensics.stop_bundle(trainer, pl_module, m, v, detail, self._culprit[0]) if nonfinite else {}
        if detail is not None and v.kind is not None:
            emit(trainer, v.onset if v.kind == "loss_spike" else step, v.kind, "stop", detail)
        saved = forensics.save_stop_checkpoints(trainer, pl_module, self.recovery)
        emit(trainer, step, "stop", "stop", {**v.detail, **extra, "kind": v.kind, "reason": reason, **saved})
        trainer.should_stop = True

    # -- the rest of the step's life --------------------------------------------------------------------------
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        current = self.measure.current
        if current is not None and current.step < trainer.global_step:  # the measured step's update is in the weights
            self.measure.current = None
            if not self.stopped:
                for c in self._hooked["after_update"]:
                    if c in self._awake:
                        c.after_update(self._view_now, current.packed.reduced)
        if self._log is not None:
            write_metrics(trainer, {**self._log, "optim/skipped_steps": float(pl_module.skipped_steps)})
            self._log = None
        # A checkpoint must hold weights and counts the checks have seen: a rollback in a streak needs the last
        # good file, which a save of NaN weights would replace. On the steps a ModelCheckpoint saves at this batch
        # end (its `every_n_train_steps`) only: a host read each.
        if self.measure.deferred and [n for n in self._save_every if trainer.global_step % n == 0]:
            self.settle(trainer, pl_module, trainer.optimizers[0])

    def continue_from(self, trainer, pl_module, restored: dict, rewarm_steps: int = 0) -> None:
        """After a restore: the step under way is dropped (computed on the abandoned weights); the LR schedule
        (re-warmed over `rewarm_steps`) and the checks' windows resume at the restored weights'; pops `applied` and
        `detectors` from `restored` (the rest is the event's)."""
        self.drop_step(pl_module)
        for c in (c for c in self.checks if hasattr(c, "restored")):  # what the abandoned weights showed
            c.restored()  # never acts on the restored ones
        pl_module.continue_from(restored.pop("applied"), trainer.global_step + self.in_step, rewarm_steps)
        windows = restored.pop("detectors")
        for c in self.checks:  # what each check had seen of the restored weights (`window_state`)
            if c.name in windows:
                c.load_window_state(windows[c.name])

    def settle(self, trainer, pl_module, optimizer=None) -> None:
        """Act on the measurement still in flight (deferred); `optimizer` None (training over): no rollback."""
        pending, self.measure.pending = self.measure.pending, None
        if pending is not None and not self.stopped:
            self.judge(trainer, pl_module, optimizer, pending.read())

    def teardown(self, trainer, pl_module, stage) -> None:
        self.recovery.close()  # the snapshots' files are removed: the fit is over

    on_exception = teardown  # (trainer, pl_module, exception), called positionally

    def on_train_end(self, trainer, pl_module) -> None:
        self.settle(trainer, pl_module)
        self.measure.finish(trainer)
        if self.stopped:
            return
        if self.spike is not None and (v := self.spike.finish()).kind is not None:
            self.apply(trainer, pl_module, None, None, v)  # ended inside a spike episode: report it
        if (final := self.recovery.final_verdict()) is not None:
            self.stop(trainer, pl_module, trainer.global_step, final, None)
        elif (cut := self.recovery.unrecovered(trainer.global_step)) is not None:
            emit(trainer, trainer.global_step, "unrecovered", "log", cut)  # a restore is a reset, not a divergence

    def _optimizer_metrics(self, trainer, pl_module) -> dict[str, float]:
        """A logging step's optimizer numbers (deferred: this step's value, the one host read of the step)."""
        metrics = {}
        m = self.measure.current.read() if self.measure.current is not None else None  # None: the step was abandoned
        if m is not None and not pl_module.clips_by_norm(trainer):  # else the module writes optim/grad_norm
            metrics["optim/grad_norm"] = m.grad_norm
        if self.spike is not None and self.spike.grad_spikes:
            metrics["stability/grad_spikes"] = float(self.spike.grad_spikes)
        if self._scaler is not None:
            metrics["optim/loss_scale"] = self._scaler.get_scale()
        return metrics

    def drop_step(self, pl_module, abandon: bool = True) -> None:
        """The step under way never reaches the weights and, with `abandon`, no later check (a restore, a stop)."""
        if self.in_step:
            for p in pl_module.parameters():
                p.grad = None
        if abandon:
            self.measure.abandon()

    # -- resume -----------------------------------------------------------------------------------------------
    def _parts(self) -> dict:
        """Everything with state a checkpoint keeps, by name (a check's is its config key)."""
        return {**{c.name: c for c in self.checks}, "recovery": self.recovery, "measure": self.measure}

    def state_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self._parts().items()}

    def load_state_dict(self, state: dict) -> None:
        for name, part in self._parts().items():
            if name in state:
                part.load_state_dict(state[name])
