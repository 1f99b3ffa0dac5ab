"""The LR-stability probe: short real training runs at the configured LR and multiples of it, before the run.

Wortsman et al. (2023) show that the instabilities of a high LR (attention-logit growth, output-logit
divergence) appear in small models within tens of steps. So the probe trains the real `GPT` with the real
objective and optimizer groups (`LMModule`) on real batches for `steps` steps at x1/3, x1, x3 and x10 the
configured peak LR (warmup compressed in proportion to the run's), and records per step the loss, the
largest attention logit, the mean log Z of the output softmax and the update/param ratio. The stability suite's
own signals watch the same steps (`Precursors.watch`: the residual stream's RMS and the max attention logit, with
the run's `callbacks.stability.signals` levels), so an LR the suite would forecast trouble for is unstable here.

An LR is *unstable* when the loss goes non-finite, when the attention logits pass `tau` (where the default
QK-clip would start acting), when the suite forecasts or alarms on its signals, or by what its loss does, judged against the start and the next lower
multiple rather than against its own first steps (which a far too high LR has already spoiled): it ends
above the untrained model's loss, gives back more than half of what it had gained, or ends higher than the
LR one multiple (3x) lower did on the same batches. The last rule says the LR is past the best LR of a
run this short, and a short run's best LR lies above a long run's; it catches what the logits cannot show,
e.g. with QK-norm, where logits stay bounded while the loss climbs. When x1 is unstable it
walks down (x1/3, x1/10, x1/30) to the largest stable LR; upwards it stops at the first unstable multiple.
A run stops as soon as its LR shows itself unstable, so unstable LRs cost a few steps. It reruns the first
unstable LR with each stabiliser the config lacks (QK-norm, z-loss 1e-4, warmup) to say which one widens
the stable region.

A model wider, deeper, longer or with a larger vocabulary than the probe's limits is probed on a proxy
(`proxy_model`) that keeps what sets the LR: the head size, the family switches, the width rule, and the
grouping of key/value heads where `max_width` leaves room for a whole group (else one key/value head, so the
probe's cost does not grow with the group size). Under mup the proxy keeps the base shape, so the narrower proxy's best LR is
the model's (muP's point). Under sp (or mup based at the model's own width) the proxy becomes a mup model whose base is the full model:
mup at the base is sp, so the proxy behaves like the full-width sp model scaled down (an sp proxy taken
narrower would tolerate a larger LR and pass an LR too high for the model). The vocabulary is cut to the
token ids the probe batches use, which is what the output layer costs on a CPU and not what sets the LR.
The probe's batch is smaller than the run's, and a smaller batch takes a lower LR: every probed LR carries the LR
rule's tokens term (`lr_rule.tokens_scale`) from the run's tokens a step to the probe's, as muP carries the width, so
the probe judges the LR the run will train at rather than that number at a batch it does not use.
The batches are read as training reads them: a mixture's (`data.sources`) at the sources' shares, the first
windows of the run's own stream, and under `data.pack=doc` with documents masked apart.
A published model (`model.init_from`) is probed from its own weights while the probe runs the model itself; a proxy
or a cut vocabulary starts fresh (`init_from=null` in the row), as its weights no longer fit.
It never writes anything and never touches the data or a checkpoint.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np
import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from steadylm.doctor.check import FAIL, OK, WARN, Check
from steadylm.lr_rule import tokens_scale
from steadylm.module import LMModule
from steadylm.schedule import Schedule, set_lr
from steadylm.stability.signals import Precursors

MULTIPLES = (1.0, 3.0, 10.0)
DOWN = (1 / 3, 1 / 9, 1 / 27, 1 / 81)  # walked while the loss keeps improving: to the best LR of a probe this short
# An LR whose loss ends further above the best lower LR's than this share of that LR's progress is too high.
EXCESS = 0.15
FLAT = 0.02  # nats: a lower LR ending within this of the one above is on the same plateau, so the walk goes on


@dataclass
class Probe:
    lr: float
    losses: list[float]
    max_logit: list[float]
    log_z: list[float]
    update_ratio: list[float]
    signal: str | None = None  # what the suite's signals said first: a forecast or an alarm, with its step

    @property
    def finite(self) -> bool:
        return all(math.isfinite(v) for v in self.losses)

    def growth(self) -> float:
        """The max logit's growth factor per 10 steps over the second half of the probe (1 = flat)."""
        half = self.max_logit[len(self.max_logit) // 2 :]
        if len(half) < 2 or not all(v > 0 and math.isfinite(v) for v in half):
            return float("inf")
        return (half[-1] / half[0]) ** (10 / (len(half) - 1))

    def end(self) -> float:
        """The mean loss of the last eighth of the steps run."""
        k = max(1, len(self.losses) // 8)
        return sum(self.losses[-k:]) / k

    def unstable(self, tau: float, best_lower: Probe | None = None) -> str | None:
        """Why this LR is unstable, or None; `best_lower` is the lower LR probed that ended lowest."""
        if not self.finite:
            return f"loss non-finite at step {next(i for i, v in enumerate(self.losses) if not math.isfinite(v))}"
        peak = max(self.max_logit)
        if peak > tau:
            step = next(i for i, v in enumerate(self.max_logit) if v > tau)
            return f"max attention logit {peak:.0f} > {tau:g} from step {step}"
        if self.signal is not None:
            return self.signal
        k = max(1, len(self.losses) // 8)
        best = min(sum(self.losses[i : i + k]) / k for i in range(len(self.losses) - k + 1))  # a smoothed minimum
        start, end = self.losses[0], self.end()
        if end >= start:
            return f"loss ended above its start ({start:.2f} -> {end:.2f}, peak {max(self.losses):.2f})"
        if end - best > 0.5 * (start - best):
            return f"loss gave back more than half its progress ({start:.2f} -> {best:.2f} -> {end:.2f})"
        if best_lower is not None and end - best_lower.end() > EXCESS * (start - best_lower.end()):
            return (
                f"loss ended {end - best_lower.end():.2f} above lr {best_lower.lr:.3g}'s "
                f"({start:.2f} -> {end:.2f} against -> {best_lower.end():.2f})"
            )
        return None

    def summary(self) -> str:
        return (
            f"lr {self.lr:.3g}: loss {self.losses[0]:.2f}->{self.end():.2f}, max logit {max(self.max_logit):.3g} "
            f"(x{self.growth():.2g}/10 steps), log Z {self.log_z[-1]:.2g}, update/param {max(self.update_ratio):.2g}"
        )


def proxy_model(model: dict, max_layers: int, max_width: int, max_context: int) -> tuple[dict, str]:
    """The model itself when small enough, else a width/depth/context-reduced copy with the same head size,
    grouping and LR semantics (the module docstring says how)."""
    m = dict(model)
    head_dim = m["d_model"] // m["n_head"]
    kv_ratio = m["n_head"] // (m.get("n_kv_head") or m["n_head"])
    n_head = max(1, min(m["n_head"], max_width // head_dim))
    if n_head >= kv_ratio:
        n_head = n_head // kv_ratio * kv_ratio
    reduced = {
        "n_layer": min(m["n_layer"], max_layers),
        "n_head": n_head,
        "n_kv_head": max(1, n_head // kv_ratio),  # the grouping where the width allows, else one k/v head
        "d_model": n_head * head_dim,
        "context_length": min(m["context_length"], max_context),
    }
    if m.get("mlp_hidden"):
        reduced["mlp_hidden"] = max(1, m["mlp_hidden"] * reduced["d_model"] // m["d_model"])
    base = m.get("mup_base_width") if m.get("parametrization") == "mup" else None
    if reduced["d_model"] != m["d_model"] and base is None and m.get("init", "gpt2") == "gpt2":
        # mup whose base is the full model (sp, or mup based at itself): muP carries its LR down to the proxy.
        reduced.update(parametrization="mup", mup_base_width=m["d_model"], mup_base_head_dim=head_dim)
    original = {**m, "n_kv_head": m.get("n_kv_head") or m["n_head"]}
    changed = {k: v for k, v in reduced.items() if original.get(k) != v}
    m.update(reduced)
    if changed and m.get("init_from"):  # a published model's weights fit its own shape only: the proxy starts fresh
        m["init_from"] = None
        changed["init_from"] = "null"
    what = ", ".join(f"{k}={v}" for k, v in changed.items())
    return m, f"proxy ({what})" if changed else "the model itself"


def probe_vocab(model: dict, batches) -> tuple[dict, str]:
    """The model with its vocabulary cut to the probe batches' token ids (padded to 64), and what changed."""
    used = max(int(max(x.max(), y.max())) for x, y in batches) + 1
    vocab = min(model["vocab_size"], -(-used // 64) * 64)
    if vocab == model["vocab_size"]:
        return model, ""
    fresh = ", init_from=null" if model.get("init_from") else ""  # the published weights fit their vocabulary only
    return {**model, "vocab_size": vocab, "init_from": None}, f"vocab_size={vocab}{fresh}"


def anneal(step: int, steps: int, floor: float) -> float:
    """The probe's LR factor: 1 for the first three quarters, then linear down to `floor` (the run's min_lr / lr).

    A run at a constant LR ends on its noise floor, which favours the lower LR of any two; annealed, it ends on
    what it learned, so an LR that ends above one 3x lower is past the best LR for this many steps, and a
    longer run's best LR lies lower still. The peak quarters show the logit growth, as before."""
    start = (3 * steps) // 4
    return 1.0 if step < start else 1.0 - (1.0 - floor) * (step - start + 1) / (steps - start)


def run_probe(
    model: dict,
    optim: dict,
    batches,
    lr: float,
    steps: int,
    warmup: int,
    clip: float | None,
    tau: float,
    signals: dict | None = None,
    doc_separator: int | None = None,
) -> Probe:
    """Train a fresh model (seed 0) for `steps` steps at peak `lr`, annealed at the end (`anneal`), its signals
    watched by a `Precursors(**signals)`; stops early once the LR shows itself unstable. `doc_separator`: the
    data's under `data.pack=doc`, as training hands it to the module."""
    floor = float(optim["min_lr"]) / float(optim["lr"]) if optim["lr"] else 1.0
    torch.manual_seed(0)
    module = LMModule(model=model, optim={**optim, "lr": lr, "fused": False}, doc_separator=doc_separator)
    opt = module.configure_optimizers()
    attns = [b.attn for b in module.net.blocks]
    params = [p for p in module.parameters() if p.requires_grad]
    out = Probe(lr, [], [], [], [])
    watch = Precursors(**{**(signals or {}), "action": "log"})
    watch.fit_to(module.net.cfg.d_model, module.net.cfg.n_layer, optim.get("name"))
    module.net.track_residual = True
    schedule = Schedule(lr=lr, min_lr=lr, warmup_steps=warmup, total_steps=steps)  # warmup, then flat at `lr`
    module.train()
    for step in range(steps):
        x, y = batches[step % len(batches)]
        set_lr(opt, schedule(step) * anneal(step, steps, floor))
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
        values = {"residual_rms": module.net.residual_rms.item()}
        if not model.get("qk_norm") and not model.get("init_from"):  # a published model has no q/k norm weights
            values["attn_logit"] = out.max_logit[-1]
        out.signal = out.signal or _signal(watch, step, values)
        if not out.finite or out.max_logit[-1] > tau or out.signal:
            break
    return out


def _signal(watch: Precursors, step: int, values: dict[str, float]) -> str | None:
    """The suite's first word on one probe step: its forecast, or a signal past its level."""
    for v in watch.watch(step, values):
        d = v.detail
        return f"the stability suite forecasts {d['signal']} {d['value']:.3g} -> {d['threshold']:g} by step {d['expected_step']}"
    for name, value in values.items():
        level = watch.levels.get(name)
        if level is not None and value > level:
            return f"{name} {value:.3g} > the suite's level {level:g} at step {step}"
    return None


def probe_windows(dm, count: int) -> list[int] | None:
    """The train window ids the probe reads: a mixture's (`data.sources`) first `count` positions of the run's own
    stream, so each source at its share as training reads it; one source's drawn with a fixed seed; None for a
    stream (it has no length to draw from: its first windows, in order)."""
    if getattr(dm, "sources", None):
        return [int(w) for w in dm.order(np.arange(count))]
    if dm.n_train_windows is None:
        return None
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, dm.n_train_windows, (count,), generator=g).tolist()


def probe_batches(
    cfg: DictConfig, context: int, n: int, batch_size: int, dm=None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` real training batches of `probe_windows`, cut to the proxy's context; `dm`: the DataModule of `cfg.data`,
    set up (None: built here)."""
    if dm is None:
        dm = instantiate(cfg.data)
        dm.setup("fit")
    ids = probe_windows(dm, n * batch_size)
    if ids is None:
        pairs = list(itertools.islice(iter(dm.train_set), n * batch_size))
    else:
        pairs = [dm.train_set[i] for i in ids]
    batches = []
    for k in range(0, len(pairs) - batch_size + 1, batch_size):
        x, y = zip(*pairs[k : k + batch_size])
        batches.append((torch.stack(x)[:, :context].contiguous(), torch.stack(y)[:, :context].contiguous()))
    return batches


@dataclass
class ProbeSweep:
    """What `probe_lrs` ran: every probed multiple of `lr` with its verdict, and the stabilisers that helped."""

    lr: float
    results: dict[float, Probe]
    verdicts: dict[float, str | None]
    first_bad: float | None
    widen: list[str]
    what: str  # the shape, tokens, steps and LRs probed, and the cost

    @property
    def best(self) -> float | None:
        """The largest stable LR probed."""
        return max((self.lr * m for m, why in self.verdicts.items() if not why), default=None)


def probe_lrs(cfg: DictConfig) -> ProbeSweep:
    """x1/3 first (the yardstick x1 is judged against), then x1, x3, x10 until the first unstable LR; below x1
    when x1 is unstable; then the first unstable LR with each stabiliser the config lacks."""
    p = cfg.probe
    started = time.perf_counter()
    model, where = proxy_model(
        OmegaConf.to_container(cfg.model, resolve=True), p.max_layers, p.max_width, p.max_context
    )
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    steps = int(p.steps)
    warmup = math.ceil(steps * int(optim["warmup_steps"]) / max(1, int(cfg.trainer.max_steps)))
    clip = cfg.trainer.get("gradient_clip_val") or None
    batch_size = min(int(cfg.data.batch_size), int(p.batch_size))
    dm = instantiate(cfg.data)
    dm.setup("fit")
    batches = probe_batches(cfg, model["context_length"], int(p.batches), batch_size, dm)
    separator = getattr(dm, "document_separator", None)  # data.pack=doc: masked apart, as training does
    model, cut = probe_vocab(model, batches)
    if cut:
        where = where[:-1] + f", {cut})" if where.startswith("proxy") else f"proxy ({cut})"
    tau = float(p.tau)
    lr = float(optim["lr"])
    scale, carried = tokens_scale(cfg, batch_size * model["context_length"])

    node = OmegaConf.select(cfg, "callbacks.stability.signals")
    signals = OmegaConf.to_container(node, resolve=True) if node is not None else None

    def probe(mult: float, model=model, optim=optim, warmup=warmup) -> Probe:
        return run_probe(model, optim, batches, lr * scale * mult, steps, warmup, clip, tau, signals, separator)

    results, prev = {1.0: probe(1.0)}, 1.0
    for m in DOWN:  # the yardstick: down while a lower LR ends no higher, or the one above is plainly unstable
        results[m] = probe(m)
        if not results[prev].unstable(tau) and results[m].finite and results[m].end() > results[prev].end() + FLAT:
            break
        prev = m

    def verdict(m: float) -> str | None:
        lower = [results[k] for k in results if k < m and results[k].finite]
        return results[m].unstable(tau, min(lower, key=Probe.end, default=None))

    verdicts = {m: verdict(m) for m in results}
    first_bad = 1.0 if verdicts[1.0] else None
    for m in MULTIPLES[1:] if first_bad is None else ():  # upwards until the first unstable LR
        results[m] = probe(m)
        verdicts[m] = verdict(m)
        if verdicts[m]:
            first_bad = m
            break
    widen = []
    if first_bad is not None:
        tries = []
        if not model.get("qk_norm") and not model.get("init_from"):  # a published model has no q/k norm weights
            tries.append(("model.qk_norm=true", {**model, "qk_norm": True}, optim, warmup))
        if not optim.get("z_loss"):
            tries.append(("optim.z_loss=1e-4", model, {**optim, "z_loss": 1e-4}, warmup))
        if not optim["warmup_steps"]:
            tries.append((f"optim.warmup_steps={max(1, cfg.trainer.max_steps // 20)}", model, optim, steps // 4))
        lower = min((results[k] for k in results if k < first_bad and results[k].finite), key=Probe.end, default=None)
        for key, m, o, w in tries:
            if not probe(first_bad, model=m, optim=o, warmup=w).unstable(tau, lower):
                widen.append(key)
    shape = f"{model['n_layer']} layers x d {model['d_model']}, {model.get('parametrization', 'sp')}"
    data = ", documents masked apart" if separator is not None else ""
    if getattr(dm, "sources", None):  # the windows each source gave, as the run's first steps take them
        read = Counter(dm.window_location(w)["source"] for w in probe_windows(dm, len(batches) * batch_size))
        data = f" of data.sources ({', '.join(f'{name} {read[name]}' for name in dm.sources)} windows){data}"
    what = (
        f"{steps} steps of {batch_size}x{model['context_length']} tokens{data} on {where} ({shape}), "
        f"lrs {', '.join(f'{lr * scale * m:.3g}' for m in sorted(results))}{carried}, {time.perf_counter() - started:.1f} s"
    )
    return ProbeSweep(lr, results, verdicts, first_bad, widen, what)


def check_lr_probe(cfg: DictConfig) -> list[Check]:
    """FAIL when the configured LR is unstable (with the largest stable LR found and the stabilisers that help),
    WARN when x3 already is (little margin), else OK; the evidence says what was probed (shape, tokens, steps,
    every LR) and what it cost."""
    name = "lr probe: stability at x1, x3, x10"
    sweep = probe_lrs(cfg)
    lr, first_bad, widen = sweep.lr, sweep.first_bad, sweep.widen
    lines = "; ".join(
        f"x{m:.3g} {r.summary()}" + (f" UNSTABLE: {why}" if (why := sweep.verdicts[m]) else "")
        for m, r in sorted(sweep.results.items())
    )
    evidence = f"{sweep.what}: {lines}"
    helps = (
        f"{' or '.join(widen)} makes lr {lr * first_bad:.3g} stable (probed)"
        if widen
        else "no single stabiliser (QK-norm, z-loss, warmup) made the first unstable LR stable"
    )
    if first_bad == 1.0:
        fix = (f"use optim.lr<={sweep.best:.3g} (the largest stable LR found)" if sweep.best else "lower optim.lr") + (
            f", or {helps}"
        )
        return [Check(name, FAIL, f"optim.lr={lr:g} is in the unstable region; {evidence}", fix)]
    if first_bad == 3.0:
        return [Check(name, WARN, f"stable at x1 but not at x3 (little margin); {evidence}", helps if widen else "")]
    return [Check(name, OK, evidence)]
