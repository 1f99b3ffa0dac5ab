"""Does the best LR found at the base width hold at 8x the width? sp against mup, on the embedded corpus.

`python benchmarks/lr_transfer.py [--widths 32,64,128,256] [--lrs -12:-4] [--steps 150] [--seeds 0,1,2] [--plot FILE]`

For each parametrisation and width: the same init seed, the same batches, the same warmup + cosine
schedule and weight decay, short runs at LRs on a grid of octaves (within 2^-12 .. 2^-3), through
steadylm's own `GPT`, `LMModule.loss` and `LMModule.configure_optimizers` (the groups and `lr_mult`s
training uses) in a plain loop; then the mean loss on fixed held-out windows. The grid is walked, not
filled: from the previous width's best octave, neighbours are run until the best one has both of its
neighbours run (about 4 runs per width instead of 10, which keeps the sweep to minutes on 2 CPU cores).
The best LR per width is the vertex of the parabola through that minimum and its neighbours (in log2
LR), and its move from the base width is printed in octaves. muP's hyperparameters are tuned at the base
width only, as its recipe says: the LR and `model.mup_output_mult` (alpha_output, --output-mults); the
wider mup models reuse the base's alpha. muP's base is the narrowest width (with alpha_output = 1 there, sp and mup are the same model).
The plot (loss vs LR, one line per width, sp | mup) goes to --plot (docs/lr_transfer.png).
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
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--family", choices=("gpt2", "llama"), default="gpt2")
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


def run(args, param: str, width: int, base: int, log2_lr: int, train, val_batches, alpha: float = 1.0) -> float:
    """The held-out loss at one point, the mean over `--seeds` (inf if any seed diverged)."""
    seeds = [int(s) for s in args.seeds.split(",")]
    return sum(run_seed(args, param, width, base, log2_lr, train, val_batches, alpha, s) for s in seeds) / len(seeds)


def run_seed(args, param, width, base, log2_lr, train, val_batches, alpha, seed: int) -> float:
    model = dict(
        n_layer=args.layers,
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
        lr=lr,
        min_lr=lr * 0.1,
        weight_decay=0.1,
        betas=[0.9, 0.95],
        eps=1e-8,
        warmup_steps=max(1, args.steps // 10),
        total_steps=args.steps,
        fused=False,
    )
    torch.manual_seed(seed)
    module = LMModule(model=model, optim=optim)
    opt = module.configure_optimizers()
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    for step in range(args.steps):
        start = step * args.batch % (len(order) - args.batch)
        x, y = batch(train, order[start : start + args.batch])
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


def plot(results: dict, widths: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = list(results)
    fig, axes = plt.subplots(1, len(params), figsize=(5.5 * len(params), 4), sharey=True, squeeze=False)
    finite = [v for p in params for w in widths for v in results[p][w].values() if math.isfinite(v)]
    top = min(max(finite), min(finite) + 2.0)
    for ax, param in zip(axes[0], params):
        for w, color in zip(widths, plt.cm.viridis([i / max(1, len(widths) - 1) for i in range(len(widths))])):
            runs = results[param][w]
            ax.plot([2.0**g for g in runs], [min(v, top) for v in runs.values()], "o-", color=color, label=f"width {w}")
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


def paired(args, results, alphas, widths, seeds, train, val_batches) -> None:
    """mup - sp at the widest width, seed by seed, each at its best grid LR: the difference and its standard
    error (the seeds' spread is larger than the gap between the means)."""
    wide, base = widths[-1], widths[0]
    best = {p: min(results[p][wide], key=results[p][wide].__getitem__) for p in ("sp", "mup")}
    diffs = []
    for s in seeds:
        sp = run_seed(args, "sp", wide, base, best["sp"], train, val_batches, alphas["sp"], s)
        mup = run_seed(args, "mup", wide, base, best["mup"], train, val_batches, alphas["mup"], s)
        diffs.append(mup - sp)
        print(f"seed {s}: sp (2^{best['sp']}) {sp:.4f}, mup (2^{best['mup']}) {mup:.4f}, mup - sp {mup - sp:+.4f}")
    se = statistics.stdev(diffs) / len(diffs) ** 0.5
    print(f"width {wide}: mup - sp = {statistics.mean(diffs):+.4f} +- {se:.4f} nats (mean, standard error)")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    widths = [int(w) for w in args.widths.split(",")]
    lo, hi = (int(v) for v in args.lrs.split(":"))
    train, val = windows(args.context)
    val_idx = list(range(0, min(len(val), args.val_windows)))
    val_batches = [batch(val, val_idx[i : i + args.batch]) for i in range(0, len(val_idx), args.batch)]
    results: dict[str, dict[int, dict[int, float]]] = {}
    t0 = time.time()
    alphas: dict[str, float] = {}
    show = lambda runs: " ".join(f"2^{g}:{v:.3f}" for g, v in runs.items())  # noqa: E731
    for param in args.parametrizations.split(","):
        # muP's hyperparameters are tuned at the base only: the LR and, for mup, alpha_output with it.
        base_runs = {}
        for alpha in [float(a) for a in args.output_mults.split(",")] if param == "mup" else [1.0]:
            evaluate = lambda g, p=param, a=alpha: run(args, p, widths[0], widths[0], g, train, val_batches, a)  # noqa: E731
            base_runs[alpha] = walk(evaluate, args.start, lo, hi)
            print(f"{param:4} width {widths[0]:4} alpha {alpha:g}: {show(base_runs[alpha])}  ({time.time() - t0:.0f}s)")
        alphas[param] = min(base_runs, key=lambda a: min(base_runs[a].values()))
        results[param] = {widths[0]: base_runs[alphas[param]]}
        start = min(results[param][widths[0]], key=results[param][widths[0]].__getitem__)
        for w in widths[1:]:
            evaluate = lambda g, p=param, w=w: run(args, p, w, widths[0], g, train, val_batches, alphas[p])  # noqa: E731
            results[param][w] = walk(evaluate, start, lo, hi)
            start = min(results[param][w], key=results[param][w].__getitem__)
            print(
                f"{param:4} width {w:4} alpha {alphas[param]:g}: {show(results[param][w])}  ({time.time() - t0:.0f}s)"
            )
    print(
        f"\n{args.family}, {args.layers} layers, {args.steps} steps x {args.batch} x {args.context} tokens; base width {widths[0]}"
    )
    print("alpha_output tuned at the base: " + ", ".join(f"{p} {a:g}" for p, a in alphas.items()))
    print("param  width  best log2(lr)  moved (octaves)  best loss")
    summary = {}
    for param in results:
        base_best = best_log2_lr(results[param][widths[0]])[0]
        for w in widths:
            best, loss = best_log2_lr(results[param][w])
            summary[f"{param}/{w}"] = {"best_log2_lr": best, "moved_octaves": best - base_best, "best_loss": loss}
            print(f"{param:5}  {w:5}  {best:13.2f}  {best - base_best:+15.2f}  {loss:9.4f}")
    wide = widths[-1]
    if {"sp", "mup"} <= set(results):
        sp_loss, mup_loss = summary[f"sp/{wide}"]["best_loss"], summary[f"mup/{wide}"]["best_loss"]
        print(f"\nwidth {wide} ({wide // widths[0]}x base): best loss mup {mup_loss:.4f} vs sp {sp_loss:.4f}")
        for param in ("sp", "mup"):
            print(
                f"{param}: optimum moved {summary[f'{param}/{wide}']['moved_octaves']:+.2f} octaves base -> {wide // widths[0]}x"
            )
    seeds = [int(s) for s in args.seeds.split(",")]
    if {"sp", "mup"} <= set(results) and len(seeds) > 1:
        paired(args, results, alphas, widths, seeds, train, val_batches)
    plot(results, widths, Path(args.plot))
    print(f"plot: {args.plot}; {time.time() - t0:.0f}s in all")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "alphas": alphas, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
