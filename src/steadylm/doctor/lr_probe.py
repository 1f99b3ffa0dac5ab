"""The LR-stability probe: short real training runs at the configured LR and multiples of it, before the run.

Wortsman et al. (2023) show that the instabilities of a high LR (attention-logit growth, output-logit
divergence) appear in small models within tens of steps. So the probe trains the real `GPT` with the real
objective and optimizer groups (`LMModule`) on real batches for `steps` steps at x1, x3 and x10 the
configured peak LR (warmup compressed in proportion to the run's), and records per step the loss, the
largest attention logit, the mean log Z of the output softmax and the update/param ratio. An LR is
*unstable* when the loss goes non-finite, when the attention logits pass `tau` (where the default QK-clip
would start acting), or when the loss ends above where it started. When x1 is unstable it walks down
(x1/3, x1/10, x1/30) to the largest stable LR; upwards it stops at the first unstable multiple. A run
stops as soon as its LR shows itself unstable, so unstable LRs cost a few steps. It reruns the first unstable LR with each stabiliser the
config lacks (QK-norm, z-loss 1e-4, warmup) to say which one widens the stable region.

A model too big for the machine is probed on a proxy: at most `max_layers` blocks and `max_width` channels
with the head size kept, context at most `max_context`. Under standard parametrisation a narrower proxy
tolerates a somewhat larger LR than the full model, so a pass on a proxy is a lower bound on the risk.
It never writes anything and never touches the data or a checkpoint.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from steadylm.doctor.check import FAIL, OK, WARN, Check
from steadylm.module import LMModule
from steadylm.schedule import Schedule, set_lr

MULTIPLES = (1.0, 3.0, 10.0)
DOWN = (1 / 3, 1 / 10, 1 / 30)


@dataclass
class Probe:
    lr: float
    losses: list[float]
    max_logit: list[float]
    log_z: list[float]
    update_ratio: list[float]

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in self.losses)

    def growth(self) -> float:
        """The max logit's growth factor per 10 steps over the second half of the probe (1 = flat)."""
        half = self.max_logit[len(self.max_logit) // 2 :]
        if len(half) < 2 or not all(v > 0 and math.isfinite(v) for v in half):
            return float("inf")
        return (half[-1] / half[0]) ** (10 / (len(half) - 1))

    def unstable(self, tau: float) -> str | None:
        """Why this LR is unstable, or None."""
        if not self.finite:
            return f"loss non-finite at step {next(i for i, v in enumerate(self.losses) if not math.isfinite(v))}"
        peak = max(self.max_logit)
        if peak > tau:
            step = next(i for i, v in enumerate(self.max_logit) if v > tau)
            return f"max attention logit {peak:.0f} > {tau:g} from step {step}"
        k = max(1, len(self.losses) // 8)
        start, end = sum(self.losses[:k]) / k, sum(self.losses[-k:]) / k
        if end >= start:
            return f"loss did not fall ({start:.2f} -> {end:.2f})"
        return None

    def summary(self) -> str:
        k = max(1, len(self.losses) // 8)
        end = sum(self.losses[-k:]) / k
        return (
            f"lr {self.lr:.3g}: loss {self.losses[0]:.2f}->{end:.2f}, max logit {max(self.max_logit):.3g} "
            f"(x{self.growth():.2g}/10 steps), log Z {self.log_z[-1]:.2g}, update/param {max(self.update_ratio):.2g}"
        )


def proxy_model(model: dict, max_layers: int, max_width: int, max_context: int) -> tuple[dict, str]:
    """The model itself when small enough, else a width/depth/context-reduced copy with the same head size."""
    m = dict(model)
    head_dim = m["d_model"] // m["n_head"]
    kv_ratio = m["n_head"] // (m.get("n_kv_head") or m["n_head"])
    n_head = max(kv_ratio, min(m["n_head"], max_width // head_dim) // kv_ratio * kv_ratio)
    reduced = {
        "n_layer": min(m["n_layer"], max_layers),
        "n_head": n_head,
        "n_kv_head": n_head // kv_ratio,
        "d_model": n_head * head_dim,
        "context_length": min(m["context_length"], max_context),
    }
    if m.get("mlp_hidden"):
        reduced["mlp_hidden"] = max(1, m["mlp_hidden"] * reduced["d_model"] // m["d_model"])
    original = {**m, "n_kv_head": m.get("n_kv_head") or m["n_head"]}
    changed = {k: v for k, v in reduced.items() if original.get(k) != v}
    m.update(reduced)
    what = ", ".join(f"{k}={v}" for k, v in changed.items())
    return m, f"proxy ({what})" if changed else "the model itself"


def run_probe(
    model: dict, optim: dict, batches, lr: float, steps: int, warmup: int, clip: float | None, tau: float
) -> Probe:
    """Train a fresh model (seed 0) for `steps` steps at peak `lr`; stops early once the LR shows itself unstable."""
    torch.manual_seed(0)
    module = LMModule(model=model, optim={**optim, "lr": lr, "fused": False})
    opt = module.configure_optimizers()
    attns = [b.attn for b in module.net.blocks]
    params = [p for p in module.parameters() if p.requires_grad]
    out = Probe(lr, [], [], [], [])
    schedule = Schedule(lr=lr, min_lr=lr, warmup_steps=warmup, total_steps=steps)  # warmup, then flat at `lr`
    module.train()
    for step in range(steps):
        x, y = batches[step % len(batches)]
        set_lr(opt, schedule(step))
        for a in attns:
            a.track_max_logit = True
        logits = module(x)
        loss, _ = module.loss(logits, y)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(params, clip)
        before = torch.cat([p.detach().flatten() for p in params])
        opt.step()
        opt.zero_grad(set_to_none=True)
        after = torch.cat([p.detach().flatten() for p in params])
        out.losses.append(loss.item())
        out.max_logit.append(max(a.max_logit.item() for a in attns))
        out.log_z.append(torch.logsumexp(logits.detach().float(), dim=-1).mean().item())
        out.update_ratio.append(((after - before).norm() / before.norm().clamp(min=1e-12)).item())
        if not out.finite or out.max_logit[-1] > tau:
            break
    return out


def probe_batches(cfg: DictConfig, context: int, n: int, batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` real training batches (fixed seed), cut to the proxy's context."""
    dm = instantiate(cfg.data)
    dm.setup("fit")
    g = torch.Generator().manual_seed(0)
    picks = torch.randint(0, len(dm.train_set), (n, batch_size), generator=g)
    batches = []
    for row in picks:
        x, y = zip(*(dm.train_set[int(i)] for i in row))
        batches.append((torch.stack(x)[:, :context].contiguous(), torch.stack(y)[:, :context].contiguous()))
    return batches


def check_lr_probe(cfg: DictConfig) -> list[Check]:
    """FAIL when the configured LR is unstable (with the largest stable LR found and the stabilisers that help),
    WARN when x3 already is (little margin), else OK; the evidence lists every probed LR and the cost."""
    name = "lr probe: stability at x1, x3, x10"
    p = cfg.probe
    started = time.perf_counter()
    model, where = proxy_model(
        OmegaConf.to_container(cfg.model, resolve=True), p.max_layers, p.max_width, p.max_context
    )
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    steps = int(p.steps)
    warmup = math.ceil(steps * int(optim["warmup_steps"]) / max(1, int(cfg.trainer.max_steps)))
    clip = cfg.trainer.get("gradient_clip_val") or None
    batches = probe_batches(
        cfg, model["context_length"], int(p.batches), min(int(cfg.data.batch_size), int(p.batch_size))
    )
    tau = float(p.tau)
    lr = float(optim["lr"])

    def probe(mult: float, model=model, optim=optim, warmup=warmup) -> Probe:
        return run_probe(model, optim, batches, lr * mult, steps, warmup, clip, tau)

    results, first_bad = {}, None
    for m in MULTIPLES:  # upwards until the first unstable LR: every larger one is unstable too
        results[m] = probe(m)
        if results[m].unstable(tau):
            first_bad = m
            break
    if first_bad == 1.0:
        for m in DOWN:
            results[m] = probe(m)
            if not results[m].unstable(tau):
                break
    stable = [m for m in results if not results[m].unstable(tau)]
    best = max(stable, default=None)
    widen = []
    if first_bad is not None:
        tries = []
        if not model.get("qk_norm"):
            tries.append(("model.qk_norm=true", {**model, "qk_norm": True}, optim, warmup))
        if not optim.get("z_loss"):
            tries.append(("optim.z_loss=1e-4", model, {**optim, "z_loss": 1e-4}, warmup))
        if not optim["warmup_steps"]:
            tries.append((f"optim.warmup_steps={max(1, cfg.trainer.max_steps // 20)}", model, optim, steps // 4))
        for key, m, o, w in tries:
            if not probe(first_bad, model=m, optim=o, warmup=w).unstable(tau):
                widen.append(key)
    seconds = time.perf_counter() - started
    lines = "; ".join(
        f"x{m:.3g} {r.summary()}" + (f" UNSTABLE: {why}" if (why := r.unstable(tau)) else "")
        for m, r in sorted(results.items())
    )
    evidence = f"{steps} steps on {where}, {seconds:.1f} s: {lines}"
    helps = (
        f"{' or '.join(widen)} makes lr {lr * first_bad:.3g} stable (probed)"
        if widen
        else "no single stabiliser (QK-norm, z-loss, warmup) made the first unstable LR stable"
    )
    if first_bad == 1.0:
        fix = (f"use optim.lr<={lr * best:.3g} (the largest stable LR found)" if best else "lower optim.lr") + (
            f", or {helps}"
        )
        return [Check(name, FAIL, f"optim.lr={lr:g} is in the unstable region; {evidence}", fix)]
    if first_bad == 3.0:
        return [Check(name, WARN, f"stable at x1 but not at x3 (little margin); {evidence}", helps if widen else "")]
    return [Check(name, OK, evidence)]
