"""Does the default parametrisation at its default LR train as well as SP at SP's own best LR, at every width?

`python benchmarks/mup_vs_sp.py [--widths 256,512,768] [--steps 300,1000] [--seeds 0,1] [--mup-alpha 4] [--json FILE]`
`python benchmarks/mup_vs_sp.py --table FILE [FILE ...]` (no runs: the table of runs saved by --json)
`python benchmarks/mup_vs_sp.py --ablate [--widths 512] [--steps 300] [--seeds 0] [--parts 0,2,3] [--at 0]`
`python benchmarks/mup_vs_sp.py --shapes 128x2@16x128,256x4@8x32 --arms sp,default [--steps 300] [--json FILE]`
`python benchmarks/mup_vs_sp.py --rule-table FILE [FILE ...]` (no runs: the LR rule's fit and table, docs/model.md)

Per width (GPT-2 family, `--layers` deep, `--heads` heads) and run length, on the embedded corpus (bytes), the
same batches and init seeds for every point: `sp` and `mup` (based at tiny's 128/32, as every preset) walked over
an LR grid of octaves of muP's default 2e-3 until the best point has both neighbours run, so no best sits on the
grid's edge; and `default`, the model and optimizer exactly as `train.py` composes them for `model=tiny` with
`model.d_model`/`model.n_head` overridden (its parametrisation, its LR: whatever the configs say now). Each point
is the mean held-out loss over `--seeds`, trained through `lr_transfer.held_out_loss` (steadylm's `GPT`,
`LMModule.loss` and `configure_optimizers`, warmup + cosine, clip 1.0). The bar: `default` within 2 % of `sp`'s
best, at every width and length.

`--shapes` runs the same arms at each WIDTHxLAYERS@BATCHxCONTEXT in turn, every run saved with its shape: the data
`optim.lr_rule` is fitted to. `--rule-table` fits log2 of sp's best LR (the vertex) on log2 width and log2 tokens
a step over the 300-step shapes not in `HELD_OUT`, and tables every shape: sp's best grid point against the
configs' default LR there, the rule's, trained by the `default` arm.

`--ablate` asks which part of muP costs the loss: muP with one part put back to SP at a time, each walked over
the same grid (the readout multiplier, the tied matrix, the embedding LR, the attention scale, the hidden init,
weight decay x m; `--at K`: each at the one LR 2e-3 x 2^K instead), and the base's own tuning (alpha_output and
the init scale walked at width 128, the best carried to the width at the base's best LR). `--parts` picks them by
number (0 sp, 1 mup, 2-7 the parts, 8 the base). Every run lands in `--json` as it ends, so an interrupted sweep keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from lr_transfer import batch, best_log2_lr, held_out_loss, walk, windows
from omegaconf import OmegaConf

from steadylm.config import compose

MUP_LR = 2e-3  # the grid's centre: muP's default LR before this benchmark; octaves of it either side
BASE = 128  # tiny's width and head size, where every preset's muP is based
BASE_HEAD = 32


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="256,512,768")
    ap.add_argument("--steps", default="300,1000", help="run lengths, comma list")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--val-windows", type=int, default=256)
    ap.add_argument(
        "--shapes",
        default=None,
        help="WIDTHxLAYERS@BATCHxCONTEXT list (128x2@16x128,...): each shape in turn, instead of --widths/--layers/...",
    )
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--arms", default="sp,default,mup", help="sp | mup | default (the configs' own), comma list")
    ap.add_argument(
        "--sp-start", type=int, default=None, help="sp walk's first log2(LR / 2e-3) (default: the default LR's)"
    )
    ap.add_argument("--mup-default-only", action="store_true", help="mup: its default LR only, no walk")
    ap.add_argument("--mup-alpha", type=float, default=1.0, help="mup: its alpha_output; not 1: an arm of its own")
    ap.add_argument("--ablate", action="store_true", help="muP's parts one at a time (at the first width)")
    ap.add_argument("--parts", default=None, help="--ablate: which, by number (0 sp, 1.. the ablations, then base)")
    ap.add_argument("--at", type=int, default=None, help="--ablate: each part at this log2(LR / 2e-3) only, no walk")
    ap.add_argument("--json", default=None, help="every run, appended as it ends (one JSON object a line)")
    ap.add_argument("--table", nargs="+", default=None, help="no runs: the table of these --json files' runs")
    ap.add_argument(
        "--rule-table", nargs="+", default=None, help="no runs: the LR rule's fit and table of --shapes runs"
    )
    return ap.parse_args()


def width_mult(model: dict) -> float:
    return model["d_model"] / model["mup_base_width"] if model["parametrization"] == "mup" else 1.0


def hidden(module) -> list[torch.nn.Parameter]:
    tables = ("wte.weight", "wpe.weight", "lm_head.weight")
    return [p for n, p in module.named_parameters() if p.dim() >= 2 and not n.endswith(tables)]


def set_group(key: str, name: str, value) -> callable:
    def tweak(module, opt, model):
        for g in opt.param_groups:
            if g["name"] == name:
                g[key] = value(model) if callable(value) else value

    return tweak


def sp_init(module, opt, model) -> None:
    """The hidden matrices at SP's N(0, 0.02) (residual projections / sqrt(2L)), not muP's / sqrt(m)."""
    with torch.no_grad():
        for p in hidden(module):
            p.mul_(math.sqrt(width_mult(model)))


def sp_attention(module, opt, model) -> None:
    for block in module.net.blocks:
        block.attn.scale = None  # SDPA's 1/sqrt(d_head)


def init_scale(k: float):
    def tweak(module, opt, model):
        with torch.no_grad():
            for p in module.parameters():
                if p.dim() >= 2:
                    p.mul_(k)

    return tweak


# muP with one part put back to what SP does: (model overrides, a tweak of the built module and optimizer).
ABLATIONS = {
    "mup": ({}, None),
    "logits x1 (alpha = m)": ({"mup_output_mult": "m"}, None),
    "untied readout": ({"tie_embeddings": False}, None),
    "embeddings at lr/m": ({}, set_group("lr_mult", "embeddings", lambda model: 1 / width_mult(model))),
    "attention 1/sqrt(d_head)": ({}, sp_attention),
    "hidden init not / sqrt(m)": ({}, sp_init),
    "weight decay not x m": ({}, set_group("weight_decay", "hidden", 0.1)),
}


class Bench:
    def __init__(self, args):
        self.args, self.t0, self.rows = args, time.time(), []
        self.seeds = [int(s) for s in args.seeds.split(",")]
        train, val = windows(args.context)
        idx = list(range(min(len(val), args.val_windows)))
        self.train = train
        self.val = [batch(val, idx[i : i + args.batch]) for i in range(0, len(idx), args.batch)]

    def model(self, width: int, param: str, **over) -> dict:
        m = dict(
            n_layer=self.args.layers,
            n_head=self.args.heads if width != BASE else BASE // BASE_HEAD,  # the base: muP's own 128/32
            d_model=width,
            context_length=self.args.context,
            vocab_size=320,
            parametrization=param,
            mup_base_width=BASE,
            mup_base_head_dim=BASE_HEAD,
        )
        m.update(over)
        if m.get("mup_output_mult") == "m":
            m["mup_output_mult"] = width / BASE
        return m

    def point(self, arm: str, model: dict, optim: dict, steps: int, tweak=None) -> float:
        """The mean held-out loss over the seeds (inf if one diverged); each run appended to --json."""
        o = {**optim, "min_lr": optim["lr"] * 0.1, "warmup_steps": max(1, steps // 10), "total_steps": steps}
        losses = []
        for seed in self.seeds:
            t = time.time()
            fix = (lambda mod, opt: tweak(mod, opt, model)) if tweak else None
            loss = held_out_loss(model, o, steps, self.args.batch, self.train, self.val, seed, tweak=fix)
            losses.append(loss)
            row = dict(arm=arm, width=model["d_model"], steps=steps, lr=o["lr"], seed=seed, loss=loss)
            row["parametrization"] = model["parametrization"]
            row.update(layers=model["n_layer"], heads=model["n_head"], batch=self.args.batch, context=self.args.context)
            self.rows.append(row)
            print(
                f"  {arm:28} d{model['d_model']} {steps} steps lr {o['lr']:.3g} seed {seed}: {loss:.4f} "
                f"({time.time() - t:.0f}s, {time.time() - self.t0:.0f}s in all)",
                flush=True,
            )
            if self.args.json:
                with open(self.args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
        return sum(losses) / len(losses)

    def at(self, arm: str, model: dict, steps: int, tweak=None, k: int | None = None) -> dict[int, float]:
        """`--at`'s one LR (or `k`), else the walk from muP's default."""
        k = self.args.at if k is None else k
        if k is None:
            return self.walked(arm, model, steps, 0, tweak)
        return {k: self.point(arm, model, {**adamw(), "lr": MUP_LR * 2.0**k}, steps, tweak)}

    def walked(self, arm: str, model: dict, steps: int, start: int, tweak=None) -> dict[int, float]:
        """log2(LR / 2e-3) -> loss, walked until the best has both neighbours."""
        optim = adamw()
        return walk(lambda k: self.point(arm, model, {**optim, "lr": MUP_LR * 2.0**k}, steps, tweak), start, -8, 4)


def adamw() -> dict:
    return dict(name="adamw", lr=MUP_LR, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, fused=True)


def default_config(width: int, heads: int, layers: int, context: int, batch_size: int) -> tuple[dict, dict]:
    """The model and optim `train.py` builds for `model=tiny` at this shape on one CPU process (the configs' own LR
    rule, which reads the width and the tokens a step)."""
    shape = [f"model.d_model={width}", f"model.n_head={heads}", f"model.n_layer={layers}"]
    cfg = compose(
        ["model=tiny", "trainer=cpu", f"model.context_length={context}", f"data.batch_size={batch_size}", *shape]
    )
    model = OmegaConf.to_container(cfg.model, resolve=True)
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    model.update(vocab_size=320)
    keep = ("name", "lr", "weight_decay", "betas", "eps")
    return model, {**{k: optim[k] for k in keep}, "fused": True}


def summary(name: str, runs: dict[int, float]) -> str:
    best, loss = best_log2_lr(runs)
    grid = " ".join(f"{MUP_LR * 2.0**k:.3g}:{v:.4f}" for k, v in runs.items())
    return f"{name}: best lr {MUP_LR * 2.0**best:.3g} (vertex), best grid loss {loss:.4f}  [{grid}]"


def compare(bench: Bench, widths: list[int], lengths: list[int]) -> None:
    args = bench.args
    for steps in lengths:
        for width in widths:
            for arm in args.arms.split(","):
                heads = bench.model(width, "sp")["n_head"]
                if arm == "default":
                    model, optim = default_config(width, heads, args.layers, args.context, args.batch)
                    bench.point("default", model, optim, steps)
                    continue
                model = bench.model(width, arm, **({"mup_output_mult": args.mup_alpha} if arm == "mup" else {}))
                name = f"mup a{args.mup_alpha:g}" if arm == "mup" and args.mup_alpha != 1.0 else arm
                if arm == "mup" and args.mup_default_only:
                    bench.point(name, model, adamw(), steps)
                else:  # sp from the default LR's octave (the width rule's) or --sp-start, mup from its own default
                    lr = default_config(width, heads, args.layers, args.context, args.batch)[1]["lr"]
                    first = round(math.log2(lr / MUP_LR)) if args.sp_start is None else args.sp_start
                    runs = bench.walked(name, model, steps, first if arm == "sp" else 0)
                    print(summary(f"{name} d{width} {steps} steps", runs), flush=True)
    print(
        f"\n{args.layers}-layer GPT-2, {args.heads} heads, {args.batch} x {args.context} tokens a step, seeds {args.seeds}"
    )
    print(table(bench.rows))


def sci(x: float, digits: int = 3) -> str:
    """3.33e-4, 2.5e-4, 1e-3: as the docs write an LR."""
    mantissa, exponent = f"{x:.{digits - 1}e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def table(rows: list[dict]) -> str:
    """The markdown table of `rows` (one run each, as --json writes them): per length and width, each point the
    mean over the seeds that ran it; the gaps are against sp's best grid point, with each seed's own in brackets."""
    runs: dict[tuple, dict[int, dict[int, float]]] = {}  # (steps, width, arm) -> log2(LR / 2e-3) -> seed -> loss
    default: dict[tuple, tuple[float, dict[int, float]]] = {}
    for r in rows:
        if r["arm"] == "default":
            default.setdefault((r["steps"], r["width"]), (r["lr"], {}))[1][r["seed"]] = r["loss"]
        else:  # sp, mup and mup at another alpha ("mup a4")
            k = round(math.log2(r["lr"] / MUP_LR))
            runs.setdefault((r["steps"], r["width"], r["arm"]), {}).setdefault(k, {})[r["seed"]] = r["loss"]

    def grid(key) -> tuple[dict[int, float], dict[int, dict[int, float]]]:
        per = runs.get(key, {})
        seeds = set().union(*per.values()) if per else set()
        return {k: sum(v.values()) / len(v) for k, v in per.items() if set(v) == seeds}, per

    def best_of(means: dict[int, float]) -> tuple[int, str]:
        k = min(means, key=means.get)
        return k, "" if k - 1 in means and k + 1 in means else ", on the grid's edge" if len(means) > 1 else ", one LR"

    def gap(loss: float, of: dict[int, float], ref: float, ref_of: dict[int, float]) -> str:
        each = ", ".join(f"{100 * (of[s] / ref_of[s] - 1):+.1f}" for s in sorted(of) if s in ref_of)
        return f"({100 * (loss / ref - 1):+.1f} % [{each}])"

    alphas = sorted({arm for *_, arm in runs if arm.startswith("mup a")})
    head = ["steps", "width", "seeds", "sp, best grid LR", "2e-3·(d/128)^-1: its LR", "mup at 2e-3 (its default)"]
    head += ["mup, best grid LR"] + [f"mup, α {a[5:]}, best grid LR" for a in alphas]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for steps, width in sorted({k[:2] for k in runs} | set(default)):
        sp, sp_per = grid((steps, width, "sp"))
        mup, mup_per = grid((steps, width, "mup"))  # and its default, 2e-3 (k = 0)
        if not sp:
            continue
        best, edge = best_of(sp)
        seeds = sorted(sp_per[best])
        sp_best = {s: min(v[s] for v in sp_per.values() if s in v) for s in seeds}  # each seed's own best
        cells = [f"{steps}", f"{width}", ",".join(map(str, seeds))]
        cells.append(
            f"{sp[best]:.4f} at {sci(MUP_LR * 2.0**best)} (vertex {sci(MUP_LR * 2.0 ** best_log2_lr(sp)[0], 2)}{edge})"
        )
        if (steps, width) in default:
            lr, of = default[(steps, width)]
            loss = sum(of.values()) / len(of)
            cells.append(f"{loss:.4f} at {sci(lr)} {gap(loss, of, sp[best], sp_best)}")
        else:
            cells.append("not run")
        cells.append(f"{mup[0]:.4f} {gap(mup[0], mup_per[0], sp[best], sp_best)}" if 0 in mup else "not run")
        for arm in ["mup", *alphas]:
            means, per = grid((steps, width, arm))
            if not means:
                cells.append("not run")
                continue
            k, edge = best_of(means)
            cells.append(f"{means[k]:.4f} at {sci(MUP_LR * 2.0**k)} {gap(means[k], per[k], sp[best], sp_best)}{edge}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# The LR rule's runs (`--shapes`): a shape is (width, layers, batch, context); rows saved before --shapes existed
# are the muP table's, 4 layers x 8 x 32. The rule is fitted on every shape but HELD_OUT, and checked on those
# (256 x 4, 384 x 3 and 512 x 4 at 16 x 128 were measured after the fit: they check it, and it misses there).
OLD_SHAPE = {"layers": 4, "batch": 8, "context": 32}
HELD_OUT = {(128, 2, 16, 32), (256, 2, 16, 128), (128, 2, 4, 512), (128, 4, 16, 128), (128, 2, 16, 512)}
HELD_OUT |= {(256, 4, 16, 128), (384, 3, 16, 128), (512, 4, 16, 128)}


def shape_of(r: dict) -> tuple[int, int, int, int]:
    return (r["width"], *(r.get(k, v) for k, v in OLD_SHAPE.items()))


def sp_bests(rows: list[dict]) -> dict[tuple, dict]:
    """(steps, shape) -> sp's walk there: the grid's seed means, the best grid point, the vertex, each seed's best."""
    per: dict[tuple, dict[int, dict[int, float]]] = {}
    for r in rows:
        if r["arm"] == "sp":
            k = round(math.log2(r["lr"] / MUP_LR))
            per.setdefault((r["steps"], shape_of(r)), {}).setdefault(k, {})[r["seed"]] = r["loss"]
    out = {}
    for key, grid in per.items():
        seeds = set().union(*grid.values())
        means = {k: sum(v.values()) / len(v) for k, v in sorted(grid.items()) if set(v) == seeds}
        best = min(means, key=means.get)
        edge = not (best - 1 in means and best + 1 in means)
        own = {s: min(v[s] for v in grid.values() if s in v) for s in seeds}
        out[key] = dict(means=means, best=best, vertex=best_log2_lr(means)[0], edge=edge, seeds=sorted(seeds), own=own)
    return out


def fit_rule(bests: dict[tuple, dict], steps: int = 300) -> tuple[float, float, float]:
    """(lr at width 128 and 2,048 tokens a step, width exponent, tokens exponent): least squares of log2 of sp's
    vertex on log2 width and log2 tokens, over the shapes not held out whose best has both neighbours."""
    import numpy as np

    keys = [k for k, b in bests.items() if k[0] == steps and k[1] not in HELD_OUT and not b["edge"]]
    x = np.array([[1.0, math.log2(w / 128), math.log2(b * t / 2048)] for _, (w, _l, b, t) in keys])
    y = np.array([bests[k]["vertex"] + math.log2(MUP_LR) for k in keys])
    (c, a, e), *_ = np.linalg.lstsq(x, y, rcond=None)
    return 2.0**c, a, e


def rule_table(rows: list[dict]) -> str:
    """The LR rule's fit on the 300-step shapes not held out, and per run length and shape: sp's best grid LR, the
    configs' default LR (the rule) and its loss against that best, from the `default` runs at the rule's current LR
    (or sp's own run where that LR is a grid point); every 1,000-step row is held out, the fit has no length term."""
    bests = sp_bests(rows)
    lr0, a, e = fit_rule(bests)
    lines = [
        f"fit (300 steps, the shapes not held out): lr = {lr0:.3g} x (width / 128)^{a:.2f} x (tokens / 2048)^{e:.2f}",
        "",
        "| steps | width x layers | batch x context (tokens) | seeds | sp, best grid LR | default: its LR | shape |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    default: dict[tuple, dict[float, dict[int, float]]] = {}
    for r in rows:
        if r["arm"] == "default":
            default.setdefault((r["steps"], shape_of(r)), {}).setdefault(r["lr"], {})[r["seed"]] = r["loss"]
    for steps, shape in sorted(bests):
        b = bests[(steps, shape)]
        width, layers, batch_size, context = shape
        heads = 4 if width == BASE else 8
        lr = default_config(width, heads, layers, context, batch_size)[1]["lr"]
        k = round(math.log2(lr / MUP_LR))
        ran = default.get((steps, shape), {}).get(lr)
        if ran is None and math.isclose(MUP_LR * 2.0**k, lr, rel_tol=1e-9) and k in b["means"]:
            ran = {
                s: next(
                    r["loss"]
                    for r in rows
                    if r["arm"] == "sp"
                    and shape_of(r) == shape
                    and r["steps"] == steps
                    and r["seed"] == s
                    and math.isclose(r["lr"], lr)
                )
                for s in b["seeds"]
            }
        edge = ", on the grid's edge" if b["edge"] else ""
        cells = [f"{steps}", f"{width} x {layers}", f"{batch_size} x {context} ({batch_size * context:,})"]
        cells += [",".join(map(str, b["seeds"]))]
        cells.append(
            f"{b['means'][b['best']]:.4f} at {sci(MUP_LR * 2.0 ** b['best'])} (vertex {sci(MUP_LR * 2.0 ** (b['vertex'] + 0), 2)}{edge})"
        )
        if ran and set(ran) >= set(b["seeds"]):
            loss = sum(ran[s] for s in b["seeds"]) / len(b["seeds"])
            each = ", ".join(f"{100 * (ran[s] / b['own'][s] - 1):+.1f}" for s in b["seeds"])
            cells.append(f"{loss:.4f} at {sci(lr)} ({100 * (loss / b['means'][b['best']] - 1):+.1f} % [{each}])")
        else:
            cells.append(f"not run (its LR {sci(lr)})")
        cells.append("held out" if shape in HELD_OUT else "fit" if steps == 300 else "held out (1,000 steps)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ablate(bench: Bench, width: int, steps: int) -> None:
    lines, n = [], len(ABLATIONS) + 2
    parts = set(range(n)) if bench.args.parts is None else {int(i) for i in bench.args.parts.split(",")}
    ref = bench.walked("sp", bench.model(width, "sp"), steps, -1) if 0 in parts else {0: math.nan}
    lines.append(summary("sp", ref))
    sp = min(ref.values())
    for i, (name, (over, tweak)) in enumerate(ABLATIONS.items(), 1):
        if i not in parts:
            continue
        runs = bench.at(name, bench.model(width, "mup", **over), steps, tweak)
        lines.append(summary(name, runs) + f"  vs sp {100 * (min(runs.values()) / sp - 1):+.1f} %")
        print(lines[-1], flush=True)
    # The base's own tuning: alpha_output and the init scale at width 128 (where mup is sp), the best carried over.
    base = {}
    if n - 1 not in parts:
        print("\n" + "\n".join(lines))
        return
    for alpha in (1.0, 4.0, 16.0):
        for scale in (0.5, 1.0, 2.0):
            if alpha != 1.0 and scale != 1.0:
                continue
            name = f"base alpha {alpha:g} init x{scale:g}"
            tweak = init_scale(scale) if scale != 1.0 else None
            runs = bench.walked(name, bench.model(BASE, "mup", mup_output_mult=alpha), steps, 0, tweak)
            base[(alpha, scale)] = runs
            lines.append(summary(name, runs))
            print(lines[-1], flush=True)
    alpha, scale = min(base, key=lambda a: min(base[a].values()))
    if (alpha, scale) != (1.0, 1.0):  # carried to the width at the base's best LR (muP's claim)
        name = f"mup, base-tuned alpha {alpha:g} init x{scale:g}"
        tweak = init_scale(scale) if scale != 1.0 else None
        k = min(base[(alpha, scale)], key=base[(alpha, scale)].get)
        runs = bench.at(name, bench.model(width, "mup", mup_output_mult=alpha), steps, tweak, k)
        lines.append(summary(name, runs) + f"  vs sp {100 * (min(runs.values()) / sp - 1):+.1f} %")
    print("\n" + "\n".join(lines))


def main() -> None:
    args = parse_args()
    for flag, paths in (("--table", args.table), ("--rule-table", args.rule_table)):
        if paths and (missing := [p for p in paths if not os.path.isfile(p)]):
            print(f"error: {flag}: no such file: {', '.join(missing)}", file=sys.stderr)
            raise SystemExit(2)
        if paths:
            rows = [json.loads(line) for path in paths for line in open(path) if line.strip()]
            print((table if flag == "--table" else rule_table)(rows))
            return
    torch.set_num_threads(1)
    widths = [int(w) for w in args.widths.split(",")]
    lengths = [int(s) for s in args.steps.split(",")]
    if args.shapes:  # one shape at a time, each with its own windows (the context) and batch
        t0 = time.time()
        for shape in args.shapes.split(","):
            (width, layers), (batch_size, context) = (map(int, half.split("x")) for half in shape.split("@"))
            compare(
                Bench(argparse.Namespace(**{**vars(args), "layers": layers, "batch": batch_size, "context": context})),
                [width],
                lengths,
            )
        print(f"{time.time() - t0:.0f}s in all")
        return
    bench = Bench(args)
    if args.ablate:
        ablate(bench, widths[0], lengths[0])
    else:
        compare(bench, widths, lengths)
    print(f"{time.time() - bench.t0:.0f}s in all")


if __name__ == "__main__":
    main()
