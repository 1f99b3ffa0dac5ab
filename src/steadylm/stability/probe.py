"""The one shared per-optimizer-step measurement: loss and pre-clip grad norm, and whether each is finite.

Taken in `on_before_optimizer_step` (after backward and every accumulated micro-batch, after the fp16
unscale, before clipping and the update), packed into ONE 2-number tensor, all-reduced ONCE across ranks and
copied to the host ONCE. The guard, the spike detector, the stats and the fp16 monitor all read this
same reduced value, so every rank takes the same decision and none waits alone in a collective.
One `StepProbe` per fit, owned by the `StabilitySuite` (`suite.py`) that every stability callback receives;
the first callback to ask pays the cost. It must never do per-tensor `.item()` calls or a second collective
per step.

Deferred (the default with a fused optimizer): reading a value on the host makes the CPU wait for the GPU,
so the GPU idles while Lightning's Python runs between steps. Instead the copy is started without waiting,
and read one step later, when it has long arrived. A non-finite step is still skipped at the step itself,
on the device: the fused AdamW kernel reads the reduced flag as `found_inf` (as GradScaler uses it) and
leaves weights, moments and step count alone. Only what follows from the host value (counting, events,
rollback, stop) happens one step late. Synchronous (read at the step itself) where the decision cannot
be made on the device: fp16's scaler, a non-fused optimizer, or a callback whose `defer` is False.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch.optim.lr_scheduler import LambdaLR

from steadylm.compat import every_n_train_steps, per_tensor_norms, set_last_lr


@dataclass(frozen=True)
class Measurement:
    step: int
    loss: float  # mean over micro-batches and ranks
    grad_norm: float  # pre-clip global L2 norm of the (already DDP-averaged) gradients
    loss_nonfinite: bool  # on any rank, in any micro-batch
    grad_nonfinite: bool
    batch_idx: tuple[int, ...] = ()  # the step's micro-batches, as the epoch's batch indices
    batches: list = field(default_factory=list, compare=False, repr=False)  # references, for the forensic re-run
    bad_params: tuple[str, ...] = field(
        default=(), compare=False
    )  # parameters whose gradient was non-finite (this rank)

    @property
    def nonfinite(self) -> bool:
        return self.loss_nonfinite or self.grad_nonfinite

    def state(self) -> dict:
        return {
            "step": self.step,
            "loss": self.loss,
            "grad_norm": self.grad_norm,
            "loss_nonfinite": self.loss_nonfinite,
            "grad_nonfinite": self.grad_nonfinite,
            "batch_idx": list(self.batch_idx),
        }


def loss_scaler(trainer: Any) -> Any:
    """The fp16 GradScaler when training under `16-mixed`, else None."""
    return getattr(trainer.precision_plugin, "scaler", None)


def can_defer(trainer) -> bool:
    """The device can skip a non-finite step by itself: fused AdamW, no fp16 scaler, no callback that objects."""
    fused = all(opt.defaults.get("fused") for opt in trainer.optimizers)
    return fused and loss_scaler(trainer) is None and all(getattr(cb, "defer", True) for cb in trainer.callbacks)


class InFlight:
    """One step's reduced [loss, norm] on its way to the host, and the per-parameter norms (kept on the device)."""

    def __init__(
        self,
        step: int,
        packed: torch.Tensor,
        norms: torch.Tensor | None,
        params: list,
        net,
        world: int,
        batches: list,
        batch_idx: list[int],
        sharded: bool = False,
    ) -> None:
        self.step, self.norms, self.params, self.net, self.world = step, norms, params, net, world
        self.sharded = sharded  # packed holds the summed squares of each rank's shard norm
        self.batches, self.batch_idx = batches, tuple(batch_idx)
        self.event = None
        if packed.device.type == "cuda":
            self.host = packed.to("cpu", non_blocking=True)  # pinned, asynchronous; the event marks its arrival
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = packed.cpu()
        self._read: Measurement | None = None

    def read(self) -> Measurement:
        if self._read is None:
            if self.event is not None:
                self.event.synchronize()
            loss, norm = self.host.tolist()
            norm = math.sqrt(norm) if self.sharded else norm / self.world
            self._read = Measurement(
                step=self.step,
                loss=loss / self.world,
                grad_norm=norm,
                loss_nonfinite=not math.isfinite(loss),
                grad_nonfinite=not math.isfinite(norm),
                batch_idx=self.batch_idx,
                batches=self.batches,
                bad_params=self._bad() if not math.isfinite(norm) else (),
            )
        return self._read

    def _bad(self) -> tuple[str, ...]:
        if self.norms is None:
            return ()
        bad = (~self.norms.isfinite()).nonzero().view(-1).tolist()  # the failure path: a host sync here is fine
        names = {id(p): n for n, p in self.net.named_parameters()}
        return tuple(names.get(id(self.params[i]), "?") for i in bad)


class Arrived(InFlight):
    """A measurement already on the host (restored from a checkpoint)."""

    def __init__(self, m: Measurement) -> None:
        self.step, self._read = m.step, m


class StepProbe:
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.batches: list = []  # this step's micro-batches (references; for the forensic re-run)
        self.batch_idx: list[int] = []
        self.deferred: bool | None = None  # decided at the first step
        self._step = -1  # the optimizer step whose measurement has been taken
        self._taken = False  # this step's measurement is taken: the next micro-batch starts a new step
        self._due: Measurement | None = None
        self._current: InFlight | None = None
        self._pending: InFlight | None = None  # deferred: this step's, read at the next one
        self._counted: set[int] = set()  # steps already in `skipped_steps`
        self.finished = False  # the end of training has been acted on

    # Several callbacks forward the same hook call; identity checks make each one count once.
    def on_batch_start(self, batch, batch_idx: int) -> None:
        if self.batches and self.batches[-1] is batch:
            return
        if self._taken:
            self.losses, self.batches, self.batch_idx, self._taken = [], [], [], False
        self.batches.append(batch)
        self.batch_idx.append(batch_idx)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        if not any(loss is seen for seen in self.losses):
            self.losses.append(loss)

    def due(self, trainer, pl_module) -> Measurement | None:
        """The measurement to act on now: this step's, or (deferred) the previous step's; None when there is none."""
        step = trainer.global_step
        if self._step == step:
            return self._due
        if self.deferred is None:
            self.deferred = can_defer(trainer)
        self._step, self._taken = step, True
        self._counted = {s for s in self._counted if s >= step - 1}
        self._current = self._launch(trainer, pl_module, step)
        if self.deferred:
            self._due = self._pending.read() if self._pending is not None else None
            self._pending = self._current
        else:
            self._due = self._current.read()
        return self._due

    def current(self, trainer, pl_module) -> Measurement | None:
        """This step's measurement now (deferred: a host sync; for logging steps). None if the step was abandoned."""
        self.due(trainer, pl_module)
        return self._current.read() if self._current is not None else None

    def _launch(self, trainer, pl_module, step: int) -> InFlight:
        device = pl_module.device
        # Lightning hands the hooks loss / accumulate_grad_batches: the sum is the step's mean loss.
        loss = (
            torch.stack([loss.detach().float() for loss in self.losses]).sum()
            if self.losses
            else torch.zeros((), device=device)
        )
        self.losses = []  # they hold the autograd graph; every micro-batch of this step has been seen
        scaler = loss_scaler(trainer)
        if scaler is not None and scaler.is_enabled():
            loss = loss / scaler.get_scale()  # the fp16 hook sees the scaled loss
        # In the optimizer's parameter order, as Lightning's clipping sums them.
        params = [p for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]] or list(
            pl_module.parameters()
        )
        with_grad = [p for p in params if p.grad is not None]
        norms = per_tensor_norms([p.grad for p in with_grad]) if with_grad else None
        norm = torch.linalg.vector_norm(norms) if norms is not None else torch.zeros((), device=device)
        pl_module.pre_clip_grad_norm = norm  # clipping reuses it instead of walking every gradient again
        world = trainer.world_size
        # Sharded (FSDP): each rank holds a slice of every gradient, so the global norm is the root of the
        # summed squares. Replicated (DDP): every rank holds the same norm, so the sum / world is it.
        sharded = world > 1 and isinstance(trainer.strategy, FSDPStrategy)
        packed = torch.stack([loss, norm.square() if sharded else norm])
        if world > 1 and torch.distributed.is_initialized():
            # Not `strategy.reduce`: it puts a barrier before the all-reduce, which makes the host wait every step.
            # A sum is non-finite when any term is (NaN, or inf of either sign), so no flags need to travel.
            torch.distributed.all_reduce(packed)
        if self.deferred:
            found_inf = (~packed.isfinite().all()).float()
            for opt in trainer.optimizers:
                opt.found_inf = found_inf  # fused AdamW skips the whole update on the device when it is 1
        net = getattr(pl_module, "net", pl_module)
        return InFlight(step, packed, norms, with_grad, net, world, list(self.batches), self.batch_idx, sharded)

    def skip(self, trainer, pl_module, m: Measurement, null_grads: bool = True) -> None:
        """Count step `m.step` as skipped (once), in `pl_module.skipped_steps`, which the LR schedule subtracts.

        Decided at the step itself: no grads -> AdamW leaves weights, moments, step count and decay alone
        (`null_grads=False` when the fp16 scaler skips it). Decided one step late: the device already skipped
        it, and the schedule has advanced past it, so this step's LR is set back by one.
        """
        self._count(pl_module, m.step)
        if m.step == trainer.global_step:
            if null_grads:
                self._null_grads(pl_module)
        else:
            reapply_schedule(trainer)

    def skip_current(self, trainer, pl_module) -> None:
        """Skip the step under way by a decision taken on the host before its update (no measurement needed)."""
        self._count(pl_module, trainer.global_step)
        self._null_grads(pl_module)

    def in_step(self, trainer) -> bool:
        """An optimizer step is under way: measured, its update not yet applied."""
        return self._step == trainer.global_step

    def abandon(self, trainer, pl_module, applied: int | None = None) -> None:
        """Nothing more of the step under way (if any) reaches the weights (rollback, stop).

        `applied`: the optimizer steps now in the weights (after a rollback); the rest count as skipped.
        """
        in_step = self.in_step(trainer)
        if in_step:
            self._null_grads(pl_module)
            if self._pending is self._current:
                self._pending = None
            self._current = None
            self._count(pl_module, trainer.global_step)
        if applied is not None:
            pl_module.skipped_steps = trainer.global_step + in_step - applied

    def _count(self, pl_module, step: int) -> None:
        """One more skipped step, unless `step` is counted already (several callbacks may skip the same one)."""
        if step not in self._counted:
            self._counted.add(step)
            pl_module.skipped_steps = getattr(pl_module, "skipped_steps", 0) + 1

    @staticmethod
    def _null_grads(pl_module) -> None:
        for p in pl_module.parameters():
            p.grad = None

    def take_pending(self) -> Measurement | None:
        """The measurement still in flight (deferred), read now; None when there is none."""
        pending, self._pending = self._pending, None
        return pending.read() if pending is not None else None

    def finish(self, trainer) -> None:
        for opt in trainer.optimizers:
            opt.__dict__.pop("found_inf", None)

    def state_dict(self) -> dict:
        """The measurement not yet acted on travels in the checkpoint: a resumed run acts on it as this one would."""
        return {"pending": self._pending.read().state() if self._pending is not None else None}

    def load_state_dict(self, state: dict | None) -> None:
        pending = (state or {}).get("pending")
        if pending:
            self._pending = Arrived(Measurement(**{**pending, "batch_idx": tuple(pending["batch_idx"])}))


def reapply_schedule(trainer) -> None:
    """Recompute this step's LR from the (changed) skipped count: the schedule lambdas read it."""
    for config in trainer.lr_scheduler_configs:
        s = config.scheduler
        if isinstance(s, LambdaLR):
            for group, base, fn in zip(s.optimizer.param_groups, s.base_lrs, s.lr_lambdas):
                group["lr"] = base * fn(s.last_epoch)
            set_last_lr(s, [group["lr"] for group in s.optimizer.param_groups])


def checkpoint_due(trainer) -> bool:
    """A ModelCheckpoint saves at this batch end (Lightning's `every_n_train_steps` rule)."""
    step = trainer.global_step
    return any((n := every_n_train_steps(cb)) and step % n == 0 for cb in trainer.checkpoint_callbacks)


CHECKPOINT_KEY = "steadylm_probe"


class ProbeUser:
    """Mixin for the stability callbacks: each receives the fit's one `StabilitySuite` (`bind`) and hands every
    measurement of its probe to `observe`.

    Every user feeds the probe (identity checks make each hook call count once), so each callback works alone
    and can be dropped from the config; the device flag is always this step's.
    """

    suite = None  # the StabilitySuite, bound by `steadylm.stability.suite.attach` (at the latest in `setup`)

    def bind(self, suite) -> None:
        self.suite = suite

    def setup(self, trainer, pl_module, stage) -> None:
        if self.suite is None:
            from steadylm.stability.suite import attach

            attach(trainer.callbacks)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.suite.probe.on_batch_start(batch, batch_idx)

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.suite.probe.on_before_backward(loss)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        m = self.suite.probe.due(trainer, pl_module)
        if m is not None:
            self.observe(trainer, pl_module, optimizer, m)

    def observe(self, trainer, pl_module, optimizer, m: Measurement) -> None:
        """Act on `m`: this step's, or an earlier one's when deferred (`probe.in_step` tells whether a step
        is under way). `optimizer` is None after training."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # A checkpoint must hold weights and counts the guard has seen: a rollback in a streak needs the
        # last good file, which a save of NaN weights would replace. On save steps only: a read each.
        if self.suite.probe.deferred and checkpoint_due(trainer):
            self.suite.settle(trainer, pl_module, trainer.optimizers[0])

    def on_train_end(self, trainer, pl_module) -> None:
        self.suite.finish(trainer, pl_module)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        checkpoint[CHECKPOINT_KEY] = self.suite.probe.state_dict()

    def on_load_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.suite.probe.load_state_dict(checkpoint.get(CHECKPOINT_KEY))
