"""`QKClipCallback`: the thin Lightning adapter that measures per-head max logits and runs `QKClip` after each step.

Every `every_n_steps` optimizer steps it switches on the attention's logit measurement (one sequence, O(T^2)
per head: `CausalSelfAttention._max_causal_logit`) for that step's forward, and after the optimizer step
hands the per-head maxima to `QKClip`, which rescales the heads above tau. Under DDP each rank measured its
own sequence, so the maxima are all-reduced with MAX first: every rank applies the same factors to the same
weights and the replicas stay identical. Each clip is a `qk_clip` event (and an LR backoff an `lr_backoff`
event) in `stability/events.jsonl`; the policy's counters ride in the checkpoint. A model with QK-norm is
left alone (rescaling W_q/W_k cannot change normalised logits); so is FSDP, whose sharded weights this
adapter does not slice. It must never change a step it did not measure.
"""

from __future__ import annotations

import logging

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import FSDPStrategy

from steadylm.stability.events import emit
from steadylm.stability.probe import reapply_schedule
from steadylm.stability.qk_clip import QKClip
from steadylm.stability.suite import suite_of

log = logging.getLogger("steadylm.stability")


class QKClipCallback(L.Callback):
    def __init__(self, every_n_steps: int = 1, rollback: bool = False, **policy) -> None:
        self.every_n_steps = max(1, int(every_n_steps))
        self.rollback = bool(rollback)
        self.policy = QKClip(**policy)
        self._armed_step = -1

    @staticmethod
    def _attns(trainer, pl_module) -> list:
        net = getattr(pl_module, "net", None)
        if net is None or net.cfg.qk_norm or isinstance(trainer.strategy, FSDPStrategy):
            return []
        return [b.attn for b in net.blocks]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step % self.every_n_steps:
            return
        attns = self._attns(trainer, pl_module)
        for attn in attns:
            attn.track_max_logit = True
        self._armed_step = trainer.global_step if attns else -1

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._armed_step < 0 or trainer.global_step <= self._armed_step:
            return  # not armed, or still accumulating micro-batches of the armed step
        step, self._armed_step = self._armed_step, -1
        attns = self._attns(trainer, pl_module)
        if any(a.head_max_logit is None for a in attns):
            return
        head_max = torch.stack([a.head_max_logit.float() for a in attns])
        for a in attns:
            a.head_max_logit = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(head_max, op=dist.ReduceOp.MAX)
        evidence = self.policy.step(step, list(head_max.cpu()), attns)  # the one host copy of a measuring step
        if evidence is None:
            return
        emit(trainer, step, "qk_clip", "clip", evidence)
        if "lr_backoff" in evidence:
            restored = self._roll_back(trainer, pl_module, evidence["onset"])
            scale_lr(trainer, evidence["lr_backoff"])
            emit(
                trainer,
                step,
                "lr_backoff",
                "backoff",
                {k: evidence[k] for k in ("lr_backoff", "lr_scale", "backoffs", "max_logit", "onset")}
                | {"reason": f"QK-clip acted on {self.policy.backoff_after} measurements in a row", **restored},
            )
        if evidence.get("exhausted"):
            log.warning("qk_clip: %d clipping steps, the budget: no more clipping this run", self.policy.clips)

    def _roll_back(self, trainer, pl_module, onset: int) -> dict:
        """Back to the newest good snapshot from before the growth began (the weights it grew are the damage)."""
        suite = suite_of(trainer)
        if not self.rollback or suite is None or suite.recovery is None:
            return {}
        restored = suite.recovery.rollback(trainer, pl_module, trainer.optimizers[0], max(0, onset - 1))
        if restored:
            emit(trainer, trainer.global_step, "rollback", "rollback", {**restored, "cause": "attn_logit growth"})
        return {"rolled_back_to": restored["to_step"]} if restored else {}

    def state_dict(self) -> dict:
        return self.policy.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.policy.load_state_dict(state_dict)


def scale_lr(trainer, factor: float) -> None:
    """Multiply the scheduled LR of every group by `factor` from this step on (the schedule's base LRs)."""
    for c in trainer.lr_scheduler_configs:
        c.scheduler.base_lrs = [lr * factor for lr in c.scheduler.base_lrs]
    reapply_schedule(trainer)
