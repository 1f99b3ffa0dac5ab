"""The one shared per-optimizer-step measurement: loss and pre-clip grad norm, and whether each is finite.

Taken in `on_before_optimizer_step` (after backward and every accumulated micro-batch, after the fp16
unscale, before clipping and the update), packed into ONE 2-number tensor, all-reduced ONCE across ranks and
copied to the host ONCE. The guard, the spike detector, the stats and the fp16 monitor all read this
same reduced value, so every rank takes the same decision and none waits alone in a collective.
The probe hangs off the Trainer so each callback works alone and the first one to ask pays the cost.
It must never do per-tensor `.item()` calls or a second collective per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Measurement:
    step: int
    loss: float  # mean over micro-batches and ranks
    grad_norm: float  # pre-clip global L2 norm of the (already DDP-averaged) gradients
    loss_nonfinite: bool  # on any rank, in any micro-batch
    grad_nonfinite: bool

    @property
    def nonfinite(self) -> bool:
        return self.loss_nonfinite or self.grad_nonfinite


def loss_scaler(trainer):
    """The fp16 GradScaler when training under `16-mixed`, else None."""
    return getattr(trainer.precision_plugin, "scaler", None)


class StepProbe:
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []
        self.batches: list = []  # this step's micro-batches (references; for the forensic re-run)
        self.batch_idx: list[int] = []
        self._measured: Measurement | None = None
        self._skipped_step = -1

    # Several callbacks forward the same hook call; identity checks make each one count once.
    def on_batch_start(self, batch, batch_idx: int) -> None:
        if self.batches and self.batches[-1] is batch:
            return
        if self._measured is not None:
            self.losses, self.batches, self.batch_idx, self._measured = [], [], [], None
        self.batches.append(batch)
        self.batch_idx.append(batch_idx)

    def on_before_backward(self, loss: torch.Tensor) -> None:
        if not any(loss is seen for seen in self.losses):
            self.losses.append(loss)

    def measure(self, trainer, pl_module) -> Measurement:
        step = trainer.global_step
        if self._measured is not None and self._measured.step == step:
            return self._measured
        device = pl_module.device
        # Lightning hands the hooks loss / accumulate_grad_batches: the sum is the step's mean loss.
        loss = torch.stack([l.detach().float() for l in self.losses]).sum() if self.losses else torch.zeros((), device=device)
        scaler = loss_scaler(trainer)
        if scaler is not None and scaler.is_enabled():
            loss = loss / scaler.get_scale()  # the fp16 hook sees the scaled loss
        # In the optimizer's parameter order, as Lightning's clipping sums them: the norm is bitwise the same.
        params = [p for opt in trainer.optimizers for g in opt.param_groups for p in g["params"]]
        grads = [p.grad for p in params or pl_module.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads).float() if grads else torch.zeros((), device=device)
        pl_module.pre_clip_grad_norm = norm  # clipping reuses it instead of walking every gradient again
        packed = torch.stack([loss, norm])
        world = trainer.world_size
        if world > 1:
            # A sum is non-finite when any term is (NaN, or inf of either sign), so no flags need to travel.
            packed = trainer.strategy.reduce(packed, reduce_op="sum")
        loss_v, norm_v = packed.tolist()
        self._measured = Measurement(
            step=step, loss=loss_v / world, grad_norm=norm_v / world, loss_nonfinite=not math.isfinite(loss_v),
            grad_nonfinite=not math.isfinite(norm_v),
        )
        return self._measured

    def skip(self, trainer, pl_module, null_grads: bool = True, total: int | None = None) -> None:
        """Skip this optimizer step: no grads -> AdamW leaves weights, moments, step count and decay alone.

        Counts the step once in `pl_module.skipped_steps` (optimizer steps whose update is not in the
        weights), which the LR schedule subtracts so a skipped step does not advance it; a rollback
        passes the new `total` instead.
        """
        if null_grads:
            for p in pl_module.parameters():
                p.grad = None
        if total is not None:
            pl_module.skipped_steps = total
        elif self._skipped_step != trainer.global_step:
            pl_module.skipped_steps = getattr(pl_module, "skipped_steps", 0) + 1
        self._skipped_step = trainer.global_step


def probe_for(trainer) -> StepProbe:
    probe = trainer.__dict__.get("_steadylm_probe")
    if probe is None:
        probe = trainer.__dict__["_steadylm_probe"] = StepProbe()
    return probe


class ProbeUser:
    """Mixin for callbacks that read the measurement: feeds the probe this step's batches and losses."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        probe_for(trainer).on_batch_start(batch, batch_idx)

    def on_before_backward(self, trainer, pl_module, loss):
        probe_for(trainer).on_before_backward(loss)
