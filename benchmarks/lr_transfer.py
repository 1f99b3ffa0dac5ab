"""Does the best LR found at the base shape hold at 8x the width, or 4x the depth? sp against mup, AdamW or Muon.

`python benchmarks/lr_transfer.py [--widths 32,64,128,256] [--base 128] [--layers 2 | --layers 2,4,8]
[--optim adamw|muon] [--muon-width-exp E] [--lrs -12:-4] [--steps 150] [--seeds 0,1,2] [--plot FILE]`

For each parametrisation and shape: the same init seed, the same batches, the same warmup + cosine
schedule and weight decay, short runs at LRs on a grid of octaves (within 2^-12 .. 2^-3), through
steadylm's own `GPT`, `LMModule.loss` and `LMModule.configure_optimizers` (the groups and `lr_mult`s
training uses) in a plain loop; then the mean loss on fixed held-out windows. The grid is walked, not
filled: from the previous shape's best octave, neighbours are run until the best one has both of its
neighbours run (about 4 runs per shape instead of 10, which keeps the sweep to minutes on 2 CPU cores).
The best LR per shape is the vertex of the parabola through that minimum and its neighbours (in log2
LR), and its move from the base shape is printed in octaves. A comma list in `--layers` sweeps depth at
the first width instead of width. muP's hyperparameters are tuned at the base width only, as its recipe
says: the LR and `model.mup_output_mult` (alpha_output, --output-mults); the wider mup models reuse the
base's alpha. muP's base is the narrowest width (with alpha_output = 1 there, sp and mup are the same
model), or `--base`: 128 is tiny's, where every preset is based, so `--widths 64,512 --base 128` is tiny
narrowed and widened as a shape override does it. `--muon-width-exp E` tries a width rule for the Muon groups under mup: their LR x width_mult^-E
(weight decay x width_mult^E); without it they get the module's own groups. The plot (loss vs LR, one line
per shape, sp | mup) goes to --plot (docs/lr_transfer.png; "" for none).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import torch

from steadylm.data.dataset import TokenWindows
from steadylm.data.prepare import prepare
from steadylm.module import LMModule
from steadylm.schedule import set_lr


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", default="32,64,128,256")
    ap.add_argument("--lrs", default="-12:-3", help="log2 LR range the walk may visit, one run per octave")
    ap.add_argument("--start", type=int, default=-8, help="log2 LR the walk starts from at the base width")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--base", type=int, default=None, help="mup: the base width (default: the narrowest width)")
    ap.add_argument("--layers", default="2", help="one depth, or a comma list: a depth sweep at the first width")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--family", choices=("gpt2", "llama"), default="gpt2")
    ap.add_argument("--optim", choices=("adamw", "muon"), default="adamw")
    ap.add_argument(
        "--muon-width-exp",
        type=float,
        default=None,
        help="mup + muon: set the Muon groups' lr_mult to width_mult^-E (a variant to compare; default: the module's)",
    )
    ap.add_argument("--parametrizations", default="sp,mup")
    ap.add_argument("--output-mults", default="1,2,4,8,16", help="mup: alpha_output values tuned at the base width")
    ap.add_argument("--val-windows", type=int, default=128)
    ap.add_argument("--seeds", default="0", help="init/data-order seeds; each point is the mean loss over them")
    ap.add_argument("--plot", default=str(Path(__file__).resolve().parents[1] / "docs" / "lr_transfer.png"))
    ap.add_argument("--json", default=None, help="also write the raw losses here")
    return ap.parse_args()


FAMILIES = {
    "gpt2": {},
    "llama": {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False},
}


def windows(context: int) -> tuple[TokenWindows, TokenWindows]:
    out = Path(tempfile.mkdtemp(prefix="lr_transfer_"))
    prepare(input=None, out_dir=out, max_bytes=1_500_000, val_fraction=0.05, progress=False)
    return (TokenWindows(sorted(out.glob(f"{split}-*.h5")), context) for split in ("train", "val"))


def batch(ds: TokenWindows, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*(ds[i] for i in idx))
    return torch.stack(xs), torch.stack(ys)


def run(args, param: str, shape: tuple[int, int], base: int, log2_lr: int, train, val_batches, alpha=1.0) -> float:
    """The held-out loss at one point, the mean over `--seeds` (inf if any seed diverged)."""
    seeds = [int(s) for s in args.seeds.split(",")]
    return sum(run_seed(args, param, shape, base, log2_lr, train, val_batches, alpha, s) for s in seeds) / len(seeds)


MUON = dict(
    lr_mult=1.0,
    adjust_lr="match_rms_adamw",
    momentum=0.95,
    nesterov=True,
    ns_steps=5,
    ns_coeffs="quintic",
    ns_dtype="float32",
)


def run_seed(args, param, shape, base, log2_lr, train, val_batches, alpha, seed: int) -> float:
    width, layers = shape
    model = dict(
        n_layer=layers,
        n_head=args.heads,
        d_model=width,
        context_length=args.context,
        vocab_size=320,
        parametrization=param,
        mup_base_width=base,
        mup_base_head_dim=base // args.heads,
        mup_output_mult=alpha,
        **FAMILIES[args.family],
    )
    lr = 2.0**log2_lr
    optim = dict(
        name=args.optim,
        lr=lr,
        min_lr=lr * 0.1,
        weight_decay=0.1,
        betas=[0.9, 0.95],
        eps=1e-8,
        warmup_steps=max(1, args.steps // 10),
        total_steps=args.steps,
        fused=False,
        muon=MUON,
    )
    exp = args.muon_width_exp if param == "mup" else None
    return held_out_loss(model, optim, args.steps, args.batch, train, val_batches, seed, muon_width_exp=exp)


def held_out_loss(model: dict, optim: dict, steps: int, batch_size: int, train, val_batches, seed: int, **kw) -> float:
    """Train `model` with `optim` (its warmup + cosine, clip 1.0) for `steps` steps in a plain loop through
    `LMModule`, then the mean loss on `val_batches` (inf if the loss went non-finite). `tweak(module, optimizer)`,
    if given, changes them before the first step (an ablation's one part)."""
    torch.manual_seed(seed)
    module = LMModule(model=model, optim=optim)
    opt = module.configure_optimizers()
    if kw.get("tweak") is not None:
        kw["tweak"](module, opt)
    if kw.get("muon_width_exp") is not None:  # a variant of `mup.muon_lr_mult`, lr · wd kept
        width = model["d_model"] / model["mup_base_width"]
        for group in opt.param_groups:
            if group.get("muon"):
                group["lr_mult"] = width ** -kw["muon_width_exp"]
                group["weight_decay"] = optim["weight_decay"] / group["lr_mult"]
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    for step in range(steps):
        start = step * batch_size % (len(order) - batch_size)
        x, y = batch(train, order[start : start + batch_size])
        loss = module.loss(module(x), y)[0]
        if not torch.isfinite(loss):
            return math.inf
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        set_lr(opt, module.schedule(step))
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        losses = [module.loss(module(x), y)[0].item() for x, y in val_batches]
    value = sum(losses) / len(losses)
    return value if math.isfinite(value) else math.inf


def walk(evaluate, start: int, lo: int, hi: int) -> dict[int, float]:
    """log2 LR -> loss, run until the best octave has both neighbours run (or sits at the range's edge)."""
    losses: dict[int, float] = {start: evaluate(start)}
    while True:
        best = min(losses, key=losses.__getitem__)
        todo = [g for g in (best - 1, best + 1) if lo <= g <= hi and g not in losses]
        if not todo:
            return dict(sorted(losses.items()))
        for g in todo:
            losses[g] = evaluate(g)


def best_log2_lr(losses: dict[int, float]) -> tuple[float, float]:
    """(log2 LR, loss) at the vertex of the parabola through the minimum and its two neighbours."""
    g = min(losses, key=losses.__getitem__)
    a, b, c = losses.get(g - 1, math.inf), losses[g], losses.get(g + 1, math.inf)
    if not (math.isfinite(a) and math.isfinite(c)):
        return float(g), b
    curv = a - 2 * b + c
    return g + (0.5 * (a - c) / curv if curv > 0 else 0.0), b


def label(shape: tuple[int, int]) -> str:
    return f"d{shape[0]} L{shape[1]}"


def plot(results: dict, shapes: list[tuple[int, int]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = list(results)
    fig, axes = plt.subplots(1, len(params), figsize=(5.5 * len(params), 4), sharey=True, squeeze=False)
    finite = [v for p in params for s in shapes for v in results[p][s].values() if math.isfinite(v)]
    top = min(max(finite), min(finite) + 2.0)
    for ax, param in zip(axes[0], params):
        for s, color in zip(shapes, plt.cm.viridis([i / max(1, len(shapes) - 1) for i in range(len(shapes))])):
            runs = results[param][s]
            ax.plot([2.0**g for g in runs], [min(v, top) for v in runs.values()], "o-", color=color, label=label(s))
            best, _ = best_log2_lr(runs)
            ax.axvline(2.0**best, color=color, ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("optim.lr (base LR; mup scales the hidden matrices' by 1/width_mult)")
        ax.set_title(f"model.parametrization={param}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out loss after the run (nats/token)")
    axes[0][-1].legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def paired(args, results, alphas, shapes, seeds, train, val_batches) -> None:
    """mup - sp at the last shape, seed by seed, each at its best grid LR: the difference and its standard
    error (the seeds' spread is larger than the gap between the means)."""
    last, base = shapes[-1], mup_base(args, shapes)
    best = {p: min(results[p][last], key=results[p][last].__getitem__) for p in ("sp", "mup")}
    diffs = []
    for s in seeds:
        sp = run_seed(args, "sp", last, base, best["sp"], train, val_batches, alphas["sp"], s)
        mup = run_seed(args, "mup", last, base, best["mup"], train, val_batches, alphas["mup"], s)
        diffs.append(mup - sp)
        print(f"seed {s}: sp (2^{best['sp']}) {sp:.4f}, mup (2^{best['mup']}) {mup:.4f}, mup - sp {mup - sp:+.4f}")
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    print(f"{label(last)}: mup - sp = {statistics.mean(diffs):+.4f} +- {se:.4f} nats (mean, standard error)")


def sweep_shapes(args) -> list[tuple[int, int]]:
    """(width, layers) per point: a width sweep at one depth, or a depth sweep at the first width."""
    widths = [int(w) for w in args.widths.split(",")]
    layers = [int(n) for n in args.layers.split(",")]
    if len(layers) > 1:
        return [(widths[0], n) for n in layers]
    return [(w, layers[0]) for w in widths]


def mup_base(args, shapes: list[tuple[int, int]]) -> int:
    """The width muP measures from: `--base`, else the first shape's (where sp and mup coincide)."""
    return args.base or shapes[0][0]


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    shapes = sweep_shapes(args)
    base = mup_base(args, shapes)
    lo, hi = (int(v) for v in args.lrs.split(":"))
    train, val = windows(args.context)
    val_idx = list(range(0, min(len(val), args.val_windows)))
    val_batches = [batch(val, val_idx[i : i + args.batch]) for i in range(0, len(val_idx), args.batch)]
    results: dict[str, dict[tuple[int, int], dict[int, float]]] = {}
    t0 = time.time()
    alphas: dict[str, float] = {}
    show = lambda runs: " ".join(f"2^{g}:{v:.3f}" for g, v in runs.items())  # noqa: E731
    for param in args.parametrizations.split(","):
        # muP's hyperparameters are tuned at the base only: the LR and, for mup, alpha_output with it.
        base_runs = {}
        for alpha in [float(a) for a in args.output_mults.split(",")] if param == "mup" else [1.0]:
            evaluate = lambda g, p=param, a=alpha: run(args, p, shapes[0], base, g, train, val_batches, a)  # noqa: E731
            base_runs[alpha] = walk(evaluate, args.start, lo, hi)
            print(f"{param:4} {label(shapes[0])} alpha {alpha:g}: {show(base_runs[alpha])}  ({time.time() - t0:.0f}s)")
        alphas[param] = min(base_runs, key=lambda a: min(base_runs[a].values()))
        results[param] = {shapes[0]: base_runs[alphas[param]]}
        start = min(results[param][shapes[0]], key=results[param][shapes[0]].__getitem__)
        for s in shapes[1:]:
            evaluate = lambda g, p=param, s=s: run(args, p, s, base, g, train, val_batches, alphas[p])  # noqa: E731
            results[param][s] = walk(evaluate, start, lo, hi)
            start = min(results[param][s], key=results[param][s].__getitem__)
            print(f"{param:4} {label(s)} alpha {alphas[param]:g}: {show(results[param][s])}  ({time.time() - t0:.0f}s)")
    print(
        f"\n{args.family}, optim={args.optim}, {args.steps} steps x {args.batch} x {args.context} tokens, "
        f"seeds {args.seeds}; mup base width {base}, LR walk from {label(shapes[0])}"
    )
    print("alpha_output tuned at the base: " + ", ".join(f"{p} {a:g}" for p, a in alphas.items()))
    print("param  shape       best log2(lr)  moved (octaves)  best loss")
    summary = {}
    for param in results:
        base_best = best_log2_lr(results[param][shapes[0]])[0]
        for s in shapes:
            best, loss = best_log2_lr(results[param][s])
            summary[f"{param}/{label(s)}"] = {
                "best_log2_lr": best,
                "moved_octaves": best - base_best,
                "best_loss": loss,
            }
            print(f"{param:5}  {label(s):10}  {best:13.2f}  {best - base_best:+15.2f}  {loss:9.4f}")
    seeds = [int(s) for s in args.seeds.split(",")]
    if {"sp", "mup"} <= set(results) and len(seeds) > 1:
        paired(args, results, alphas, shapes, seeds, train, val_batches)
    if args.plot:
        plot(results, shapes, Path(args.plot))
        print(f"plot: {args.plot}")
    print(f"{time.time() - t0:.0f}s in all")
    if args.json:
        raw = {p: {label(s): runs for s, runs in r.items()} for p, r in results.items()}
        Path(args.json).write_text(json.dumps({"results": raw, "alphas": alphas, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
