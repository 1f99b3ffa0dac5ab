"""`GradParamStats`: the numbers that show a run drifting toward divergence before it gets there.

Every `every_n_steps` steps (chosen to coincide with the logging steps): per-block grad norm, param norm and
update/param ratio ‖Δθ‖/‖θ‖ (params copied before the update on those steps only), max attention logit per
layer (tracking switched on for that step only, on one sequence) and activation RMS per block (forward hooks
on that step only) and the mean log Z of the output logits (the log of the softmax normaliser: Wortsman et al.
2023's output-logit divergence shows as its drift). All of a measured step's tensors are stacked and copied to the host once. Alarms
(`update_ratio`, `attn_logit`) are `log` verdicts; they never change training.
The owner calls `arm` at the step's first micro-batch, `before_update` after backward and `after_update`
once the update is in the weights.
"""

from __future__ import annotations

import math

import torch

from steadylm.compat import copy_tensors, per_tensor_norms, sub_tensors
from steadylm.logging_steps import is_logging_step
from steadylm.stability.verdict import Verdict


class GradParamStats:
    def __init__(
        self, every_n_steps: int = 10, update_ratio_alarm: float = 1.0, attn_logit_alarm: float = 100.0
    ) -> None:
        self.every_n_steps = max(1, int(every_n_steps))
        self.update_ratio_alarm = float(update_ratio_alarm)
        self.attn_logit_alarm = float(attn_logit_alarm)
        self.armed_step = -1
        self._hooks: list = []
        self._act: dict[int, torch.Tensor] = {}
        self._log_z: torch.Tensor | None = None
        self._params: list[torch.nn.Parameter] = []  # the armed step's parameters, and a copy from before its update
        self._before: list[torch.Tensor] = []
        self._owner: torch.Tensor | None = None  # block index of each parameter (n_blocks for the rest)
        self._owner_key: tuple = ()
        self._grad_norms: torch.Tensor | None = None

    @staticmethod
    def _blocks(pl_module) -> list[torch.nn.Module]:
        return list(getattr(pl_module.net, "blocks", []))

    def arm(self, step: int, pl_module) -> None:
        """Switch the per-block measurements on for step `step`, when it is a stats step."""
        if not is_logging_step(step, self.every_n_steps) or self.armed_step == step:
            return
        self.armed_step = step
        for i, block in enumerate(self._blocks(pl_module)):
            block.attn.track_max_logit = True
            self._hooks.append(block.register_forward_hook(self._rms_hook(i)))
        head = getattr(pl_module.net, "lm_head", None)
        if head is not None:
            self._hooks.append(head.register_forward_hook(self._log_z_hook))

    def _log_z_hook(self, module, args, out) -> None:
        self._log_z = out.detach().float().logsumexp(-1).mean()

    def _rms_hook(self, i: int):
        def hook(module, args, out):
            self._act[i] = out.detach().float().pow(2).mean().sqrt()

        return hook

    def before_update(self, step: int, pl_module) -> None:
        """Per-block grad norms and a copy of the weights the update will be applied to (armed steps only)."""
        if self.armed_step != step:
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
            norms = per_tensor_norms(grads)
        else:  # a parameter without a gradient this step (a skipped step) counts as 0
            norms = torch.stack(
                [g.norm().float() if g is not None else torch.zeros((), device=pl_module.device) for g in grads]
            )
        self._grad_norms = self._per_block(norms, len(blocks))
        self._before = copy_tensors([p.detach() for p in self._params])  # one copy kernel, not one per tensor

    def _per_block(self, norms: torch.Tensor, n: int) -> torch.Tensor:
        squares = torch.zeros(n + 1, device=norms.device).index_add_(0, self._owner, norms.square())
        return squares[:n].sqrt()

    def after_update(self, step: int, pl_module) -> tuple[dict[str, float], list[Verdict]]:
        """The armed step's metrics and alarms once its update is applied (`step`: the optimizer steps done)."""
        if self.armed_step < 0 or step <= self.armed_step:
            return {}, []  # not armed, or still accumulating micro-batches of the armed step
        armed, self.armed_step = self.armed_step, -1
        for h in self._hooks:
            h.remove()
        self._hooks = []
        blocks = self._blocks(pl_module)
        for b in blocks:
            b.attn.track_max_logit = False
        if not self._before:
            return {}, []  # the step ended without an optimizer step
        n = len(blocks)
        delta = sub_tensors([p.detach() for p in self._params], self._before)
        param, moved = per_tensor_norms(self._before), per_tensor_norms(delta)
        # ‖Δθ‖/‖θ‖ against the weights the update was applied to (after a blow-up ‖θ_new‖ ≈ ‖Δθ‖).
        param_norms, delta_norms = self._per_block(param, n), self._per_block(moved, n)
        totals = torch.stack([moved.square().sum().sqrt(), param.square().sum().sqrt()])
        logits = [b.attn.max_logit if b.attn.max_logit is not None else torch.zeros(()) for b in blocks]
        acts = [self._act.get(i, torch.zeros(())) for i in range(n)]
        log_z = self._log_z if self._log_z is not None else torch.tensor(float("nan"))
        for b in blocks:
            b.attn.max_logit = None
        self._params, self._before, self._act, self._log_z = [], [], {}, None
        device = totals.device
        rows = [
            self._grad_norms,
            param_norms,
            delta_norms,
            *(torch.stack([t.to(device).float() for t in r]).view(-1) for r in (logits, acts) if r),
            totals,
            log_z.to(device).float().view(1),
        ]
        values = torch.cat(rows).tolist()  # the one host copy of a measured step
        return self._report(armed, values, n)

    def _report(self, step: int, values: list[float], n: int) -> tuple[dict[str, float], list[Verdict]]:
        grad, param, delta, logit, act = (values[k * n : (k + 1) * n] for k in range(5))
        total_delta, total_param, log_z = values[5 * n : 5 * n + 3]
        ratio = [d / max(p, 1e-12) for d, p in zip(delta, param)]
        total_ratio = total_delta / max(total_param, 1e-12)
        metrics = {"stability/update_ratio": total_ratio}
        if not math.isnan(log_z):  # NaN: no output head was measured
            metrics["stability/log_z"] = log_z
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
        alarms = []
        worst = max([total_ratio, *ratio])
        if worst > self.update_ratio_alarm:
            block = max(range(n), key=ratio.__getitem__) if n else None
            detail = {"value": worst, "threshold": self.update_ratio_alarm, "global": total_ratio, "block": block}
            alarms.append(Verdict("log", "update_ratio", detail, onset=step))
        if n and max(logit) > self.attn_logit_alarm:
            i = max(range(n), key=logit.__getitem__)
            detail = {"value": logit[i], "threshold": self.attn_logit_alarm, "block": i}
            alarms.append(Verdict("log", "attn_logit", detail, onset=step))
        return metrics, alarms
