"""`GradParamStats`: the numbers that show a run drifting toward divergence before it gets there, on the logging
steps only: per-block grad norm, param norm and update ratio ‖Δθ‖/‖θ‖, max attention logit, activation RMS, and the
output's mean log Z (Wortsman et al. 2023). They travel in the step's collective, the update's (from a device copy
of the weights) in the next step's, with no host read of their own; the alarms are `log` verdicts.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import torch

from steadylm.compat import copy_tensors, per_tensor_norms, sub_tensors
from steadylm.distributed import local
from steadylm.logging_steps import is_logging_step
from steadylm.stability.check import Check
from steadylm.stability.verdict import OK, Verdict

OWN, UPDATE = ("grad", "log_z", "logit", "act"), ("param", "delta", "total")  # a stats step's values; its update's


def describe(events: list[dict], log) -> list[dict]:
    """diagnose's findings from the alarms: each kind's first, a symptom (rank 2) that names the cause only when
    nothing else explains it; an update-ratio alarm after quiet measurements is first-hand: one step moved the
    weights too far (an LR spike)."""
    found = []
    for e in [next((e for e in events if e["kind"] == kind), None) for kind in ("attn_logit", "update_ratio")]:
        if e is None:
            continue
        d, step = e["detail"], e["step"]
        alarm = f"(alarm {d.get('threshold', float('nan')):g})"
        if e["kind"] == "attn_logit":
            summary = f"max attention logit {d.get('value', float('nan')):.3g} in blocks.{d.get('block')} at step {step} {alarm}"
            fix = "enable model.qk_norm=true (and/or optim.z_loss=1e-4), or lower optim.lr"
            found.append({"onset": step, "cause": "attention logit growth", "summary": summary, "fix": fix, "rank": 2})
            continue
        summary = f"update/param ratio {d.get('value', float('nan')):.3g} at step {step}"
        found.append(
            {
                "onset": step,
                "cause": "oversized updates",
                "summary": f"{summary} {alarm}",
                "rank": 2,
                "fix": "lower optim.lr or lengthen optim.warmup_steps",
            }
        )
        steps, values = log.series("stability/update_ratio")
        quiet = values[(steps < step) & np.isfinite(values)]
        if len(quiet) and not (quiet > d.get("threshold", 1.0)).any():  # not the whole recipe too hot: one step
            found.append(
                {
                    "onset": step,
                    "cause": "oversized update (LR spike)",
                    "summary": f"{summary} after {len(quiet)} quiet measurement(s) (max {quiet.max():.2g}): one update "
                    "moved the weights too far",
                    "fix": "check the LR the optimizer really used (scheduler state after a resume, a manual LR change); "
                    "callbacks.stability.spike.action=rollback undoes such a step",
                }
            )
    return found


def stats_metrics(values: dict) -> dict[str, float]:
    """The logged metrics of a stats step from its reduced values (`OWN` or `UPDATE`, whichever `values` holds)."""
    metrics = {}
    if "grad" in values:
        if not math.isnan(values["log_z"][0]):  # NaN: the module keeps no log Z (`LMModule.head_loss`)
            metrics["stability/log_z"] = values["log_z"][0]
        for i, (grad, logit, act) in enumerate(zip(values["grad"], values["logit"], values["act"])):
            metrics[f"stability/grad_norm/block_{i}"] = grad
            metrics[f"stability/max_attn_logit/block_{i}"] = logit
            metrics[f"stability/act_rms/block_{i}"] = act
    if "delta" in values:
        total_delta, total_param = values["total"]
        metrics["stability/update_ratio"] = total_delta / max(total_param, 1e-12)
        for i, (delta, param) in enumerate(zip(values["delta"], values["param"])):
            metrics[f"stability/param_norm/block_{i}"] = param
            metrics[f"stability/update_ratio/block_{i}"] = delta / max(param, 1e-12)
    return metrics


class GradParamStats(Check):
    name = "stats"

    def __init__(self, every_n_steps=None, update_ratio_alarm=1.0, attn_logit_alarm=100.0) -> None:
        self.configured = every_n_steps  # None: on the logging steps (`applies`), where the metrics are written
        self.every_n_steps = max(1, int(every_n_steps or 1))
        self.update_ratio_alarm, self.attn_logit_alarm = float(update_ratio_alarm), float(attn_logit_alarm)
        self.armed_step = -1
        self._hooks: list = []
        self._act: dict[int, torch.Tensor] = {}
        self._owner: torch.Tensor | None = None  # block index of each parameter (n_blocks for the rest)
        self._owner_key: tuple = ()
        self._held: dict | None = None  # the stats step's device values, waiting for its update

    def applies(self, trainer) -> bool:
        self.every_n_steps = max(1, int(self.configured or trainer.log_every_n_steps))
        return True

    def _sleep_after(self, step: int) -> None:
        """Asleep (`Check.next_step`) until the first stats step after `step`: a quiet step costs nothing."""
        n = self.every_n_steps
        self.next_step = step + 1 + (n - 1 - (step + 1) % n)  # the stats steps are those with (s + 1) % n == 0

    def arm(self, view) -> None:
        """Switch the per-block measurements on for this step, when it is a stats step."""
        if not is_logging_step(view.step, self.every_n_steps):
            if self._held is None:
                self._sleep_after(view.step)
            return
        self.armed_step, net = view.step, view.module.net
        for i, block in enumerate(getattr(net, "blocks", [])):
            block.attn.track_max_logit = True
            self._hooks.append(block.register_forward_hook(partial(self._rms_hook, i)))

    def _rms_hook(self, i: int, module, args, out) -> None:
        self._act[i] = out.detach().float().pow(2).mean().sqrt()

    def measure(self, view) -> dict:
        """The last stats step's update, now in the weights; on a stats step its own numbers, and a device copy of
        the weights its update will be applied to."""
        out = {}
        if self._held is not None:
            held, self._held = self._held, None
            n, before = held["n"], held["before"]
            param = per_tensor_norms(before)
            moved = per_tensor_norms(sub_tensors([local(p.detach()) for p in held["params"]], before))
            # ‖Δθ‖/‖θ‖ against the weights the update was applied to (after a blow-up ‖θ_new‖ ≈ ‖Δθ‖).
            totals = torch.stack([moved.square().sum().sqrt(), param.square().sum().sqrt()])
            out = {"param": ("norm", self._per_block(param, n)), "delta": ("norm", self._per_block(moved, n))}
            out["total"] = ("norm", totals)
        if self.armed_step == view.step:
            out.update(self._hold(view.module))
        else:
            self._sleep_after(view.step)
        return out

    def _hold(self, pl_module) -> dict:
        self.armed_step = -1
        for h in self._hooks:
            h.remove()
        self._hooks = []
        blocks = list(getattr(getattr(pl_module, "net", None), "blocks", []))
        params = [p for p in pl_module.parameters() if p.requires_grad]
        key = tuple(map(id, params))
        if self._owner is None or self._owner_key != key:  # built once: a host-to-device copy
            owner_of = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
            self._owner = torch.tensor([owner_of.get(id(p), len(blocks)) for p in params], device=pl_module.device)
            self._owner_key = key
        grads = [local(p.grad) if p.grad is not None else None for p in params]  # FSDP: this rank's slices
        zero = torch.zeros((), device=pl_module.device)
        if all(g is not None for g in grads):
            norms = per_tensor_norms(grads)
        else:  # a parameter without a gradient this step (a skipped step) counts as 0
            norms = torch.stack([g.norm().float() if g is not None else zero for g in grads])
        logits = [b.attn.max_logit if b.attn.max_logit is not None else zero for b in blocks]
        for b in blocks:
            b.attn.track_max_logit, b.attn.max_logit = False, None
        log_z = getattr(pl_module, "log_z", None)  # the loss's own by-product (`LMModule.head_loss`)
        log_z = log_z.detach() if log_z is not None else torch.tensor(float("nan"))
        acts = [self._act.get(i, zero).float() for i in range(len(blocks))]
        before = copy_tensors([local(p.detach()) for p in params])
        self._held = {"params": params, "before": before, "n": len(blocks)}
        self._act = {}
        return {
            "grad": ("norm", self._per_block(norms, len(blocks))),
            "log_z": ("mean", log_z.to(zero.device).float().view(1)),
            "logit": ("max", torch.stack([t.float().to(zero.device) for t in logits]) if blocks else zero.view(0)),
            "act": ("max", torch.stack(acts) if blocks else zero.view(0)),
        }

    def _per_block(self, norms: torch.Tensor, n: int) -> torch.Tensor:
        squares = torch.zeros(n + 1, device=norms.device).index_add_(0, self._owner, norms.square())
        return squares[:n].sqrt()

    def restored(self) -> None:
        """Weights restored: the held copy is of weights that no longer exist."""
        self._held = None

    def verdict(self, m, view) -> list[Verdict] | Verdict:
        """The metrics and alarms, at the stats step, of its numbers that travelled with `m` (its own, its update's)."""
        values = m.values.get(self.name)
        if not values:
            return OK
        out = []
        if "delta" in values:  # the update of the stats step before `m.step`
            metrics = stats_metrics({k: values[k] for k in UPDATE})
            out.append(Verdict(onset=m.step - 1, metrics=metrics))
            ratio = [metrics[k] for k in metrics if k.startswith("stability/update_ratio/block_")]
            total = metrics["stability/update_ratio"]
            worst = max([total, *ratio])
            if worst > self.update_ratio_alarm:
                block = max(range(len(ratio)), key=ratio.__getitem__) if ratio else None
                detail = {"value": worst, "threshold": self.update_ratio_alarm, "global": total, "block": block}
                out.append(Verdict("log", "update_ratio", detail, onset=m.step - 1))
        if "grad" in values:  # `m.step` is a stats step
            out.append(Verdict(onset=m.step, metrics=stats_metrics({k: values[k] for k in OWN})))
            logit = values["logit"]
            if logit and max(logit) > self.attn_logit_alarm:
                i = max(range(len(logit)), key=logit.__getitem__)
                detail = {"value": logit[i], "threshold": self.attn_logit_alarm, "block": i}
                out.append(Verdict("log", "attn_logit", detail, onset=m.step))
        return out
