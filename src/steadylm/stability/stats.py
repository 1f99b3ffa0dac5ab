"""`GradParamStats`: the numbers that show a run drifting toward divergence before it gets there.

On Lightning's logging steps (from the probe's one reduced host copy, read on these steps only): `optim/grad_norm`
(pre-clip, which Lightning's clipping computes and throws away) and `optim/skipped_steps`. Every
`every_n_steps` steps, chosen to coincide with the logging steps: per-block grad norm, param norm and
update/param ratio ‖Δθ‖/‖θ‖ (params snapshotted before the update on those steps only), max attention
logit per layer (tracking switched on for that step only, on one sequence) and activation RMS per block
(forward hooks on that step only). All of a logging step's tensors are stacked and copied to the host once.
Alarms (`update_ratio`, `attn_logit`) go to the events log; they never change training.
"""

from __future__ import annotations

import lightning as L
import torch

from steadylm.compat import copy_tensors, per_tensor_norms, sub_tensors
from steadylm.logging_steps import will_log, write_metrics
from steadylm.stability.events import emit
from steadylm.stability.probe import ProbeUser


class GradParamStats(ProbeUser, L.Callback):
    def __init__(
        self, every_n_steps: int = 10, update_ratio_alarm: float = 1.0, attn_logit_alarm: float = 100.0
    ) -> None:
        self.every_n_steps = max(1, int(every_n_steps))
        self.update_ratio_alarm = float(update_ratio_alarm)
        self.attn_logit_alarm = float(attn_logit_alarm)
        self._armed_step = -1
        self._hooks: list = []
        self._act: dict[int, torch.Tensor] = {}
        self._params: list[torch.nn.Parameter] = []  # the armed step's parameters, and a copy from before its update
        self._before: list[torch.Tensor] = []
        self._owner: torch.Tensor | None = None  # block index of each parameter (n_blocks for the rest)
        self._owner_key: tuple = ()
        self._grad_norms: torch.Tensor | None = None
        self._grad_norm: float | None = None  # this logging step's pre-clip norm, until batch end

    @staticmethod
    def _blocks(pl_module) -> list[torch.nn.Module]:
        return list(getattr(pl_module.net, "blocks", []))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        step = trainer.global_step
        # Lightning writes logs when (step + 1) % log_every_n_steps == 0; measure on those steps.
        if (step + 1) % self.every_n_steps or self._armed_step == step:
            return
        self._armed_step = step
        for i, block in enumerate(self._blocks(pl_module)):
            block.attn.track_max_logit = True
            self._hooks.append(block.register_forward_hook(self._rms_hook(i)))

    def _rms_hook(self, i: int):
        def hook(module, args, out):
            self._act[i] = out.detach().float().pow(2).mean().sqrt()

        return hook

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        super().on_before_optimizer_step(trainer, pl_module, optimizer)
        if will_log(trainer):
            m = self.suite.probe.current(trainer, pl_module)  # deferred: the logging step's one host read
            self._grad_norm = m.grad_norm if m is not None else None  # written at batch end, beside the skip count
        if self._armed_step != trainer.global_step:
            return
        blocks = self._blocks(pl_module)
        self._params = [p for p in pl_module.parameters() if p.requires_grad]
        key = tuple(map(id, self._params))
        if self._owner is None or self._owner_key != key:  # built once: a host-to-device copy
            owner_of = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
            self._owner = torch.tensor(
                [owner_of.get(id(p), len(blocks)) for p in self._params], device=pl_module.device
            )
            self._owner_key = key
        grads = [p.grad for p in self._params]
        if all(g is not None for g in grads):
            norms = self._norms(grads)
        else:  # a parameter without a gradient this step counts as 0
            norms = torch.stack(
                [g.norm().float() if g is not None else torch.zeros((), device=pl_module.device) for g in grads]
            )
        self._grad_norms = self._per_block(norms, len(blocks))
        self._before = copy_tensors([p.detach() for p in self._params])  # one copy kernel, not one per tensor

    @staticmethod
    def _norms(tensors: list[torch.Tensor]) -> torch.Tensor:
        """Per-tensor L2 norms in one fused call (the per-block sums below are then one scatter, not a loop)."""
        return per_tensor_norms(tensors)

    def _per_block(self, norms: torch.Tensor, n: int) -> torch.Tensor:
        squares = torch.zeros(n + 1, device=norms.device).index_add_(0, self._owner, norms.square())
        return squares[:n].sqrt()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._grad_norm is not None:
            metrics = {"optim/skipped_steps": float(getattr(pl_module, "skipped_steps", 0))}
            if not getattr(pl_module, "clips_by_norm", lambda t: False)(trainer):  # else the module writes it
                metrics["optim/grad_norm"] = self._grad_norm
            write_metrics(trainer, metrics)
            self._grad_norm = None
        if self._armed_step < 0 or trainer.global_step <= self._armed_step:
            return  # not armed, or still accumulating micro-batches of the armed step
        step, self._armed_step = self._armed_step, -1
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if not self._before:
            return  # the step ended without an optimizer step
        blocks = self._blocks(pl_module)
        n = len(blocks)
        delta = sub_tensors([p.detach() for p in self._params], self._before)
        param, moved = self._norms(self._before), self._norms(delta)
        # ‖Δθ‖/‖θ‖ against the weights the update was applied to (after a blow-up ‖θ_new‖ ≈ ‖Δθ‖).
        param_norms, delta_norms = self._per_block(param, n), self._per_block(moved, n)
        totals = torch.stack([moved.square().sum().sqrt(), param.square().sum().sqrt()])
        logits = [b.attn.max_logit if b.attn.max_logit is not None else torch.zeros(()) for b in blocks]
        acts = [self._act.get(i, torch.zeros(())) for i in range(n)]
        for b in blocks:
            b.attn.track_max_logit, b.attn.max_logit = False, None
        self._params, self._before, self._act = [], [], {}
        device = totals.device
        rows = [
            self._grad_norms,
            param_norms,
            delta_norms,
            *(torch.stack([t.to(device).float() for t in r]).view(-1) for r in (logits, acts) if r),
            totals,
        ]
        values = torch.cat(rows).tolist()  # the one host copy of a logging step
        self._log(trainer, pl_module, step, values, len(blocks))

    def _log(self, trainer, pl_module, step: int, values: list[float], n: int) -> None:
        grad, param, delta, logit, act = (values[k * n : (k + 1) * n] for k in range(5))
        total_delta, total_param = values[5 * n], values[5 * n + 1]
        ratio = [d / max(p, 1e-12) for d, p in zip(delta, param)]
        total_ratio = total_delta / max(total_param, 1e-12)
        metrics = {"stability/update_ratio": total_ratio}
        for i in range(n):
            metrics.update(
                {
                    f"stability/grad_norm/block_{i}": grad[i],
                    f"stability/param_norm/block_{i}": param[i],
                    f"stability/update_ratio/block_{i}": ratio[i],
                    f"stability/max_attn_logit/block_{i}": logit[i],
                    f"stability/act_rms/block_{i}": act[i],
                }
            )
        write_metrics(trainer, metrics)
        worst = max([total_ratio, *ratio])
        if worst > self.update_ratio_alarm:
            emit(
                trainer,
                step,
                "update_ratio",
                "log",
                {
                    "value": worst,
                    "threshold": self.update_ratio_alarm,
                    "global": total_ratio,
                    "block": max(range(n), key=ratio.__getitem__) if n else None,
                },
            )
        if n and max(logit) > self.attn_logit_alarm:
            i = max(range(n), key=logit.__getitem__)
            emit(
                trainer, step, "attn_logit", "log", {"value": logit[i], "threshold": self.attn_logit_alarm, "block": i}
            )
