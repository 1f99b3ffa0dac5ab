"""`Stability`: the one callback that owns each optimizer step's stability checks.

One optimizer step, as Lightning runs it:

- `on_train_batch_start` (each micro-batch): the batch is kept for the measurement; stats arm their hooks on
  a stats step; every N steps `Recovery` starts a snapshot;
- forward, loss, backward (`LMModule`); each micro-batch's loss reaches `on_before_backward`;
- `on_before_optimizer_step` -> `step` (read it: the whole order is there);
- `LMModule.on_before_optimizer_step`: every group's LR from the applied steps and the LR scale; clipping; the update;
- `on_train_batch_end`: QK-clip bounds the attention logits the next step starts from; the stats of the update;
  before a checkpoint, the measurement in flight is acted on.

The checks (`guard`, `spike`, `loss_scale`, `qk_clip`, `stats`, `recovery`) are plain classes with their own state; they
return `Verdict`s and this class applies them, so escalation, the rollback budget and the stop live here.
Every decision comes from the one all-reduced measurement, so every rank applies the same verdicts: no rank
ever raises or stops alone.
"""

from __future__ import annotations

import inspect

import lightning as L
import torch
import torch.distributed as dist
from hydra.utils import instantiate
from lightning.pytorch.strategies import FSDPStrategy
from omegaconf import DictConfig, OmegaConf

from steadylm.checkpointing import STABILITY_STATE_KEY
from steadylm.compat import every_n_train_steps
from steadylm.errors import ConfigError
from steadylm.logging_steps import will_log, write_metrics
from steadylm.stability.check import StepView, measures
from steadylm.stability.events import KINDS, emit
from steadylm.stability.forensics import name_culprit, write_bundle
from steadylm.stability.guard import NonFiniteGuard
from steadylm.stability.init_loss import InitLoss
from steadylm.stability.loss_scale import LossScaleMonitor
from steadylm.stability.measure import Measurement, StepMeasure, loss_scaler
from steadylm.stability.qk_clip import QKClip
from steadylm.stability.recovery import Recovery, restore_weights_and_optimizer
from steadylm.stability.rollback import checkpoint_dir
from steadylm.stability.signals import Precursors, signal_values
from steadylm.stability.spike import SpikeDetector
from steadylm.stability.stats import GradParamStats
from steadylm.stability.suspects import batch_window_ids, spike_suspects
from steadylm.stability.verdict import Verdict

NONFINITE = ("nonfinite_loss", "nonfinite_grad")


def checkpoint_due(trainer) -> bool:
    """A ModelCheckpoint saves at this batch end (Lightning's `every_n_train_steps` rule)."""
    step = trainer.global_step
    return any((n := every_n_train_steps(cb)) and step % n == 0 for cb in trainer.checkpoint_callbacks)


def _part(name: str, cls, settings):
    """A check built from its config node `callbacks.stability.<name>`, or None when the node is null (removed)."""
    if settings is None:
        return None
    settings = OmegaConf.to_container(settings) if isinstance(settings, DictConfig) else dict(settings)
    known = [p for p in inspect.signature(cls).parameters]
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ConfigError(f"callbacks.stability.{name}.{unknown[0]} is not a setting; use one of {', '.join(known)}")
    return cls(**settings)


BUILT_IN = ("guard", "spike", "stats", "loss_scale", "qk_clip", "init_loss", "recovery", "signals", "measure")


def _checks_from_config(nodes) -> list:
    """The checks named under `callbacks.stability.checks` (`<name>: {_target_: ...}`), each called `<name>`."""
    out = []
    for name, node in (nodes or {}).items():
        if node is None:
            continue  # removed from the command line (`callbacks.stability.checks.<name>=null`)
        where = f"callbacks.stability.checks.{name}"
        if name in BUILT_IN:
            raise ConfigError(f"{where}: {name!r} is a built-in part's name; call the check something else")
        check = node  # Hydra has built it already when the Trainer's callbacks were instantiated
        if isinstance(node, (dict, DictConfig)):
            if "_target_" not in node:
                raise ConfigError(f"{where} has no _target_ (the check's class, e.g. my_package.checks.MyCheck)")
            check = instantiate(node)
        if not callable(getattr(check, "verdict", None)):
            raise ConfigError(f"{where}: {type(check).__name__} has no verdict(m, view) method (see Check)")
        check.name = name
        out.append(check)
    return out


class Stability(L.Callback):
    """`callbacks.stability`: each part is tunable (`callbacks.stability.spike.sigma=5`) or removable
    (`callbacks.stability.spike=null`); without `recovery` a rollback reads the checkpoints on disk."""

    def __init__(
        self,
        guard=None,
        spike=None,
        stats=None,
        loss_scale=None,
        qk_clip=None,
        init_loss=None,
        recovery=None,
        signals=None,
        checks=None,
        defer: bool = True,
    ):
        if not isinstance(defer, bool):
            raise ConfigError(f"callbacks.stability.defer={defer!r} must be true or false")
        self.guard = _part("guard", NonFiniteGuard, guard)
        self.spike = _part("spike", SpikeDetector, spike)
        self.stats = _part("stats", GradParamStats, stats)
        self.loss_scale = _part("loss_scale", LossScaleMonitor, loss_scale)
        self.qk_clip = _part("qk_clip", QKClip, qk_clip)
        self.init_loss = _part("init_loss", InitLoss, init_loss)
        self.signals = _part("signals", Precursors, signals)
        self.recovery = _part("recovery", Recovery, recovery if recovery is not None else {"every_n_steps": 0})
        # Judged in this order, the built-in checks first, then `callbacks.stability.checks` in config order.
        self.checks = [c for c in (self.guard, self.spike, self.loss_scale, self.init_loss) if c is not None]
        self.checks += _checks_from_config(checks)
        self._judged, self._measuring = self.checks, []  # settled at the fit's start (`setup`)
        self._attns: list = []  # the attention layers QK-clip acts on (`setup`)
        self._rewinds = any(p is not None and p.backoff.rewind for p in (self.qk_clip, self.signals))
        # A check that must act before this step's update (a skip) needs its value at the step: no deferral.
        self.measure = StepMeasure(
            defer=defer and not any(getattr(c, "acts_before_update", False) for c in self.checks)
        )
        self.stopped = False
        self.in_step = False  # inside `step`: the step under way has not reached the weights
        self._skipped_at = -1  # the last step counted as skipped (several checks may skip the same step)
        self._culprit: tuple[str | None, str] = (None, "")  # the module named at the start of a non-finite streak
        self._log: dict[str, float] | None = None  # this logging step's optimizer metrics, written at batch end
        self._clip_armed = -1  # the step whose logits QK-clip measures

    @property
    def state_key(self) -> str:
        return STABILITY_STATE_KEY

    # -- Lightning's hooks ------------------------------------------------------------------------------------
    def setup(self, trainer, pl_module, stage: str) -> None:
        self._judged = [c for c in self.checks if c.applies(trainer)]
        self._measuring = [c for c in self._judged if measures(c)]
        self._attns = self._clip_targets(trainer, pl_module) if self.qk_clip is not None else []

    def _windows_to_keep(self) -> dict:
        """What a snapshot keeps of the checks beside the weights: the spike detector's window."""
        return {"spike": self.spike.window_state()} if self.spike is not None else {}

    def _view(self, trainer, pl_module) -> StepView:
        scaler = loss_scaler(trainer)
        return StepView(
            step=trainer.global_step,
            world_size=trainer.world_size,
            loss_scale=scaler.get_scale() if scaler is not None else None,
            model_cfg=getattr(getattr(pl_module, "net", None), "cfg", None),
            trainer=trainer,
            module=pl_module,
        )

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.measure.add_batch(batch, batch_idx)
        if self.stats is not None:
            self.stats.arm(trainer.global_step, pl_module)
        if self.qk_clip is not None and self.qk_clip.due(trainer.global_step):
            for attn in self._attns:
                attn.track_max_logit = True
            self._clip_armed = trainer.global_step
        if self._rewinds:
            self._hold_first_through_warmup(trainer, pl_module)
        self.recovery.maybe_snapshot(trainer, pl_module, self._windows_to_keep)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.measure.add_loss(loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.in_step = True
        try:
            self.step(trainer, pl_module, optimizer)
        finally:
            self.in_step = False

    def step(self, trainer, pl_module, optimizer) -> None:
        """One optimizer step's checks, in order: after backward, before clipping, the LR and the update."""
        step = trainer.global_step
        self.recovery.written()  # 0. this step's snapshot has read the weights it copies: they may change now
        view = self._view(trainer, pl_module)
        extra = self._measured_logits(step)
        m = self.measure.take(trainer, pl_module, view, self._measuring, extra)  # 1. the one measurement (deferred: the
        # previous step's), every check's own values in the same collective
        if self.recovery.in_skip_window(step):  # the data window skipped after a repeated rollback
            self.skip(trainer, pl_module, step)
        if m is not None:
            self.judge(trainer, pl_module, optimizer, m, view)  # 2-6. the checks' verdicts, applied
        if self.stopped:
            return
        if self.stats is not None:  # 7. stats: the grads and weights this update starts from (after any rollback)
            self.stats.before_update(step, pl_module)
        if will_log(trainer):
            self._log = self._optimizer_metrics(trainer, pl_module)

    def judge(self, trainer, pl_module, optimizer, m: Measurement, view: StepView | None = None) -> None:
        """Every check's verdict on `m`, in order (2. guard: non-finite, skip, a streak -> rollback; 3. spike:
        persisting -> rollback; 4. fp16 loss scale; step 0's loss against ln(V); then the checks named in config);
        the snapshot of `m.step` is confirmed or dropped (5), and the verdicts are applied in the same order (6; a
        rollback or a stop ends the list: it acted on `m`)."""
        view = view or self._view(trainer, pl_module)
        verdicts = [c.verdict(m, view) for c in self._judged]
        self.recovery.confirm(m, suspect=any(v.suspect for v in verdicts))  # 5. known-good snapshot, or dropped
        for v in verdicts:  # 6. act
            if v.action != "ok" and self.apply(trainer, pl_module, optimizer, m, v):
                return  # rolled back or stopped: the logits of `m` belong to the abandoned weights
        head_max = m.values.get("qk_clip", {}).get("head_max")
        if head_max is not None:  # 7. QK-clip's record of the clip of `m.step`: counts, events, a backoff
            self._account_clip(trainer, pl_module, m.step, head_max)

    # -- applying verdicts ------------------------------------------------------------------------------------
    def apply(self, trainer, pl_module, optimizer, m: Measurement, v: Verdict) -> bool:
        """Carry out one verdict and write its event; True when it rolled back or stopped the run."""
        detail = dict(v.detail)
        if v.kind in NONFINITE:
            if v.context.get("first"):
                module, evidence, _ = name_culprit(trainer, pl_module, m)  # every rank: one object all-gather
                self._culprit = (module, evidence)
            detail.update(module=self._culprit[0], evidence=self._culprit[1], batch=self._windows(trainer, m))
        episode = v.context.get("episode")
        if episode is not None:
            detail["batch"] = [batch_window_ids(trainer, i) for i in episode["batch_idx"]]
        if v.action == "skip":
            self.skip(trainer, pl_module, m.step)
        elif v.action == "log" and v.context.get("rank"):  # a one-off spike: rank its samples on the good weights
            snap = self.recovery.newest_good(before=v.onset)
            detail.update(spike_suspects(trainer, pl_module, episode, snap, snap.step if snap else None))
        elif v.action == "rollback":
            self.rollback(trainer, pl_module, optimizer, m, v, detail)
            return True
        elif v.action == "stop":
            self.stop(trainer, pl_module, m.step, v, detail, m=m)
            return True
        if v.kind is not None:
            emit(trainer, v.onset if v.onset is not None else m.step, v.kind, v.action, detail)
        return False

    def skip(self, trainer, pl_module, step: int) -> None:
        """Step `step` does not count: its update never reaches the weights and the LR does not advance.

        Decided at the step itself: no grads, so the optimizer leaves weights, moments, step count and decay
        alone. Decided a step late (deferred): the device already skipped it; only the count is left to do.
        """
        if step == self._skipped_at:
            return
        self._skipped_at = step
        pl_module.skip_step()
        if self.in_step and step == trainer.global_step:
            self._drop_grads(pl_module)

    def rollback(self, trainer, pl_module, optimizer, m: Measurement, v: Verdict, detail: dict) -> None:
        restored = self.recovery.rollback(trainer, pl_module, optimizer, v.onset) if optimizer is not None else None
        if restored is None:
            self.stop(trainer, pl_module, m.step, v, detail, why=self.recovery.why_not(), m=m)
            return
        if self.in_step:  # the step under way was computed on the abandoned weights
            self._drop_grads(pl_module)
            self.measure.abandon()
        self._continue_from(trainer, pl_module, restored)
        if "lr_backoff" in restored:
            restored["lr_scale"] = pl_module.scale_lr(restored["lr_backoff"])
        episode = v.context.get("episode")
        if episode is not None:  # a persisting spike: re-run its onset batch on the restored weights
            evidence = spike_suspects(trainer, pl_module, episode, None, restored["to_step"])
            cause, why = SpikeDetector.cause(episode, evidence.get("batch_loss_on_good_weights"), restored["to_step"])
            detail.update(cause=cause, evidence=why, **evidence)
        emit(trainer, v.onset if episode is not None else m.step, v.kind, "rollback", detail)
        restored.update(cause=v.kind, onset=v.onset, module=detail.get("module"))
        emit(trainer, m.step, "rollback", "rollback", restored)

    def stop(self, trainer, pl_module, step: int, v: Verdict, detail: dict, why=None, m=None) -> None:
        """Stop every rank together (all reach it from the same reduced values), keeping the last good state.

        `why`: what made the verdict's own remedy impossible; `m`: the measurement behind it (for the forensics).
        """
        self.stopped = True
        if self.in_step:
            self._drop_grads(pl_module)
            self.measure.abandon()
        reason = f"{v.reason}; {why}" if why else v.reason
        extra = {}
        if v.kind in NONFINITE and m is not None:
            extra = self._forensics(trainer, pl_module, m, v, detail)
        if v.kind in KINDS or v.kind in {c.name for c in self.checks}:
            emit(trainer, v.onset if v.kind == "loss_spike" else step, v.kind, "stop", detail)
        saved = self._save_last_good(trainer, pl_module)
        emit(trainer, step, "stop", "stop", {**v.detail, **extra, "kind": v.kind, "reason": reason, **saved})
        trainer.should_stop = True

    def _forensics(self, trainer, pl_module, m: Measurement, v: Verdict, detail: dict) -> dict:
        """The bundle of a non-finite stop (`stability/forensics/step_N.json`); what the stop event says of it."""
        module, evidence, report = name_culprit(trainer, pl_module, m)
        first = self._culprit[0]
        bundle = {
            "step": m.step,
            "streak_start": v.onset,
            "kind": v.kind,
            "module": module or first,
            "evidence": evidence,
            "first_module": first,
            "batch": detail.get("batch"),
            "rank": trainer.global_rank,
            **report,
        }
        path = write_bundle(trainer, m.step, bundle)
        return {
            "module": first or module,
            "consecutive": detail.get("consecutive"),
            "forensics": str(path) if path else None,
        }

    def _save_last_good(self, trainer, pl_module) -> dict:
        """`diverged.ckpt` (the state now) beside `last_good.ckpt` (the newest known-good snapshot); the run ends
        on the good weights. Every rank calls it: saving is collective."""
        folder = checkpoint_dir(trainer)
        out = {}
        try:
            trainer.save_checkpoint(folder / "diverged.ckpt")
            out["broken_checkpoint"] = str(folder / "diverged.ckpt")
            snap = self.recovery.newest_good()
            if snap is not None:
                restore_weights_and_optimizer(trainer, pl_module, snap)
                # The LR of a resume from it continues where those weights left off.
                pl_module.continue_from(snap.applied, trainer.global_step)
                trainer.save_checkpoint(folder / "last_good.ckpt")
                out.update(last_good_checkpoint=str(folder / "last_good.ckpt"), last_good_step=snap.step)
        except Exception as err:  # the stop itself must happen even when the disk is full
            out["checkpoint_error"] = f"{type(err).__name__}: {err}"
        return out

    # -- the rest of the step's life --------------------------------------------------------------------------
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.recovery.written()  # (a step with no update: QK-clip below still changes weights)
        if self.stats is not None:
            metrics, alarms = self.stats.after_update(trainer.global_step, pl_module)
            if metrics:
                write_metrics(trainer, metrics)
            for v in alarms:
                emit(trainer, v.onset, v.kind, v.action, v.detail)
            if metrics and self.signals is not None and not self.stopped:
                self.watch_signals(trainer, pl_module, metrics)
        if self.qk_clip is not None and not self.stopped:
            self.clip_logits(trainer, pl_module)
        if self._log is not None:
            write_metrics(trainer, {**self._log, "optim/skipped_steps": float(pl_module.skipped_steps)})
            self._log = None
        # A checkpoint must hold weights and counts the checks have seen: a rollback in a streak needs the last
        # good file, which a save of NaN weights would replace. On save steps only: a host read each.
        if self.measure.deferred and checkpoint_due(trainer):
            self.settle(trainer, pl_module, trainer.optimizers[0])

    # -- QK-clip: after the update, so the next step starts from bounded logits ----------------------------------
    @staticmethod
    def _clip_targets(trainer, pl_module) -> list:
        """The attention layers QK-clip can act on: none under QK-norm (rescaling W_q/W_k cannot change normalised
        logits) or FSDP (whose sharded weights it does not slice)."""
        net = getattr(pl_module, "net", None)
        if net is None or net.cfg.qk_norm or isinstance(trainer.strategy, FSDPStrategy):
            return []
        return [b.attn for b in net.blocks]

    def _measured_logits(self, step: int) -> dict:
        """This step's per-head max logits (layers x heads), for the step's one collective (MAX over ranks)."""
        if self._clip_armed != step or any(a.head_max_logit is None for a in self._attns) or not self._attns:
            return {}
        return {"qk_clip": {"head_max": ("max", torch.stack([a.head_max_logit.float() for a in self._attns]))}}

    def clip_logits(self, trainer, pl_module) -> None:
        """Clip on the device the heads the measured step saw over tau: the maxima reduced in the step's collective,
        so every rank applies the same factors. The host's record of it comes with the step's measurement."""
        if self._clip_armed < 0 or trainer.global_step <= self._clip_armed:
            return  # not measured, or still accumulating micro-batches of the measured step
        self._clip_armed = -1
        for a in self._attns:
            a.head_max_logit, a.track_max_logit = None, False
        head_max = self.measure.maxed("qk_clip", "head_max")
        if head_max is not None:
            self.qk_clip.clip(head_max, self._attns)

    def _disarm_clip(self, trainer, pl_module) -> None:
        """Forget a max-logit measurement in flight (every rank rolls back at the same step, so all forget it)."""
        self._clip_armed = -1
        for a in self._attns:
            a.head_max_logit, a.track_max_logit = None, False

    def _account_clip(self, trainer, pl_module, step: int, head_max: list) -> bool:
        """The events of step `step`'s clip (its reduced logits, on the host); an LR backoff it asks for, and its
        rewind. True when it rewound."""
        evidence = self.qk_clip.account(step, torch.tensor(head_max))
        if evidence is None:
            return False
        emit(trainer, step, "qk_clip", "clip", evidence)
        if "lr_backoff" not in evidence:
            return False
        keys = ("lr_backoff", "lr_scale", "backoffs", "max_logit", "onset")
        keys += ("rewind_before", "rewind_latest", "rewind_first", "growth_from")  # QKClip.rewind_target
        why = f"QK-clip acted on {self.qk_clip.backoff_after} measurements in a row"
        return self.back_off(
            trainer,
            pl_module,
            step,
            "qk_clip",
            self.qk_clip.backoff,
            {k: evidence[k] for k in keys if k in evidence},
            why,
        )

    # -- precursor signals: after the stats of a measured step ---------------------------------------------------
    def watch_signals(self, trainer, pl_module, metrics: dict[str, float]) -> None:
        """The precursor signals of the stats step just measured, reduced with MAX over ranks (one small
        all-reduce on stats steps only): forecasts and alarms logged, a persisting alarm backed off from."""
        net = getattr(pl_module, "net", None)
        values = signal_values(metrics, qk_norm=bool(net is not None and net.cfg.qk_norm))
        if not values:
            return
        if trainer.world_size > 1 and dist.is_initialized():
            packed = torch.tensor(list(values.values()), device=pl_module.device, dtype=torch.float64)
            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
            values = dict(zip(values, packed.tolist()))
        step = trainer.global_step - 1  # the update just measured
        clip_acts = bool(self._attns)
        in_warmup = self._in_warmup(pl_module, trainer.global_step)
        verdicts = self.signals.observe(step, values, in_warmup, may_back_off=not clip_acts)
        for v in verdicts:
            emit(trainer, v.onset, v.kind, v.action, v.detail)
            if v.kind == "forecast":
                write_metrics(trainer, {f"stability/forecast/{v.detail['signal']}": float(v.detail["expected_step"])})
        for v in verdicts:
            request = v.context.get("backoff")
            if request is not None:
                why = (
                    f"{request['signal']} stayed above {request['threshold']:g} on {self.signals.persist} "
                    f"measurements in a row"
                )
                keys = ("lr_backoff", "lr_scale", "backoffs", "onset", "rewind_before", "signal", "value")
                detail = {k: request[k] for k in keys if k in request}
                self.back_off(trainer, pl_module, step, request["signal"], self.signals.backoff, detail, why)

    @staticmethod
    def _in_warmup(pl_module, step: int) -> bool:
        """The LR is still ramping up at optimizer step `step` (the first warmup, or a re-warmup after a rewind)."""
        applied = pl_module.applied_steps(step)
        warmup = int(getattr(pl_module, "optim_cfg", {}).get("warmup_steps", 0))
        start, length = getattr(pl_module, "rewarm", (0, 0))
        return applied < warmup or (length > 0 and applied < start + length)

    # -- the one LR backoff: QK-clip's and the precursor signals' ------------------------------------------------
    def back_off(self, trainer, pl_module, step: int, cause: str, backoff, detail: dict, why: str) -> bool:
        """Apply a backoff a check's `Backoff` granted (`detail`: its evidence): the LR scale times the factor,
        a rewind to the good snapshot from before `rewind_before` (and a re-warmup), the `lr_backoff` event and
        the rollback's. Every rank reaches it from the same reduced values. True when it rewound."""
        pl_module.scale_lr(detail["lr_backoff"])
        keys = ("rewind_before", "rewind_latest", "rewind_first", "growth_from")
        target = {k: detail.pop(k) for k in keys if k in detail}  # QK-clip's rewind_target, else before the onset
        detail = {**detail, "cause": cause, "reason": why}
        restored = None
        if "rewind_before" in target:
            target = {"rewind_latest": target["rewind_before"], "rewind_first": True, **target}
            # the LR ramps up again from the restored weights over `rewarm_steps`, as at the start
            restored = self._rewind(trainer, pl_module, target, backoff.rewarm_steps)
        if restored is not None:
            detail["rewound_to"] = restored["to_step"]
            if "growth_from" in target:
                detail["growth_from"] = target["growth_from"]  # the last step the logits were below the floor
            if backoff.rewarm_steps:
                detail["rewarm_steps"] = backoff.rewarm_steps
        emit(trainer, step, "lr_backoff", "backoff", detail)
        if restored is not None:
            emit(trainer, step, "rollback", "rollback", {**restored, "cause": cause, "onset": detail["onset"]})
        for part in (self.qk_clip, self.signals):  # one backoff answers every check's streak: each starts again
            if part is not None:
                part.restart()
        return restored is not None

    def _hold_first_through_warmup(self, trainer, pl_module) -> None:
        """Growth that crosses tau during the LR warmup began near the start (at 10x the stable LR the max logit is
        10x the stable run's by step 19 and crosses 100 at 60): recovery holds the fit's first snapshot until
        the warmup, and a streak begun at its end, are over; a rewind then goes back to it."""
        warmup = int(getattr(pl_module, "optim_cfg", {}).get("warmup_steps", 0))
        after = [(self.qk_clip.backoff_after or 0) * self.qk_clip.every_n_steps] if self.qk_clip else []
        if self.signals is not None and self.stats is not None:
            after.append(self.signals.persist * self.stats.every_n_steps)
        hold = pl_module.applied_steps() <= warmup + max(after, default=0)
        if hold and not self.recovery.hold_first:
            self.recovery.hold_first = True
        elif not hold and self.recovery.hold_first:
            self.recovery.release_first()

    def _rewind(self, trainer, pl_module, target: dict, rewarm_steps: int) -> dict | None:
        """Back to the snapshot QK-clip's `rewind_target` names (the weights grown since are the damage the clip
        cannot undo); the LR schedule resumes where those weights left off."""
        restored = self.recovery.rewind(
            trainer, pl_module, target["rewind_before"], target["rewind_latest"], to_first=target["rewind_first"]
        )
        if restored is None:
            return None
        if self.in_step:  # the step under way was computed on the abandoned weights
            self._drop_grads(pl_module)
        self.measure.abandon()  # the step just done measured the abandoned weights
        self._continue_from(trainer, pl_module, restored, rewarm_steps)
        return restored

    def _continue_from(self, trainer, pl_module, restored: dict, rewarm_steps: int = 0) -> None:
        """After a restore: the LR schedule resumes at the restored weights' applied steps, the checks' windows
        at theirs. Pops `applied` and `detectors` from `restored` (the rest is the event's)."""
        self._disarm_clip(trainer, pl_module)  # logits measured on the abandoned weights never clip the restored
        pl_module.continue_from(restored.pop("applied"), trainer.global_step + self.in_step, rewarm_steps)
        windows = restored.pop("detectors")
        if self.spike is not None and "spike" in windows:
            self.spike.load_window_state(windows["spike"])
        if self.guard is not None:
            self.guard.rolled_back()

    def settle(self, trainer, pl_module, optimizer=None) -> None:
        """Act on the measurement still in flight (deferred); `optimizer` None (training over): no rollback."""
        m = self.measure.take_pending()
        if m is not None and not self.stopped:
            self.judge(trainer, pl_module, optimizer, m)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.recovery.close()  # the snapshots' files are removed: the fit is over

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.recovery.close()

    def on_train_end(self, trainer, pl_module) -> None:
        self.settle(trainer, pl_module)
        if self.spike is not None and not self.stopped:
            v = self.spike.finish()  # ended inside a spike episode: report it
            if v.kind is not None:
                batch = [batch_window_ids(trainer, i) for i in v.context["episode"]["batch_idx"]]
                emit(trainer, v.onset, v.kind, v.action, {**v.detail, "batch": batch})
        final = self.recovery.final_verdict() if not self.stopped else None
        if final is not None:
            self.stop(trainer, pl_module, trainer.global_step, final, {})
        elif not self.stopped and (cut := self.recovery.unrecovered(trainer.global_step)) is not None:
            emit(trainer, trainer.global_step, "unrecovered", "log", cut)  # a restore is a reset, not a divergence
        self.measure.finish(trainer)

    def _optimizer_metrics(self, trainer, pl_module) -> dict[str, float]:
        """A logging step's optimizer numbers (deferred: this step's value, the one host read of the step)."""
        metrics = {}
        m = self.measure.now()
        if m is not None and not pl_module.clips_by_norm(trainer):  # else the module writes optim/grad_norm
            metrics["optim/grad_norm"] = m.grad_norm
        if self.spike is not None and self.spike.grad_spikes:
            metrics["stability/grad_spikes"] = float(self.spike.grad_spikes)
        scaler = loss_scaler(trainer)
        if scaler is not None:
            metrics["optim/loss_scale"] = scaler.get_scale()
        return metrics

    @staticmethod
    def _windows(trainer, m: Measurement) -> list[list[int]]:
        return [batch_window_ids(trainer, i) for i in m.batch_idx]

    @staticmethod
    def _drop_grads(pl_module) -> None:
        for p in pl_module.parameters():
            p.grad = None

    # -- resume -----------------------------------------------------------------------------------------------
    def _parts(self) -> dict:
        """Everything with state a checkpoint keeps, by name (a check's is its config key)."""
        parts = {c.name: c for c in self.checks}
        parts.update(qk_clip=self.qk_clip, signals=self.signals, recovery=self.recovery, measure=self.measure)
        return {name: part for name, part in parts.items() if part is not None}

    def state_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self._parts().items()}

    def load_state_dict(self, state: dict) -> None:
        self.measure.load_state_dict(state.get("measure"))
        for name, part in self._parts().items():
            if name != "measure" and name in state:
                part.load_state_dict(state[name])
