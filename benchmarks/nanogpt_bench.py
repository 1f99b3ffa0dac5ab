"""steadylm's training step against nanoGPT's, side by side in one process (issue 24, item 4).

nanoGPT is neither a dependency nor copied here: `--nanogpt` names a checkout
(`git clone https://github.com/karpathy/nanoGPT`) and its `model.py` is imported from there. Two ratios, each
from samples taken side by side (bench.py's pairing and bootstrap, its verdict against 1.00: "at least
nanoGPT's tokens/s"):

  steadylm / nanoGPT, whole step   inside one `trainer.fit` of `train.py`'s path, after every Lightning step
                                   (default suite on) one nanoGPT step runs on the same batch and is timed on
                                   its own: its GPT at the same shape, its `configure_optimizers` (fused AdamW
                                   on CUDA only, as it writes it), forward with targets, backward,
                                   `clip_grad_norm_`, the same warmup/cosine LR, step, zero_grad
  steadylm / nanoGPT, model only   the same plain loop around each model (steadylm's `GPT` with its loss and
                                   AdamW recipe against nanoGPT's), a pair of steps at a time in random order:
                                   what the model and optimizer cost apart from Lightning and the suite

Default shape: the issue's 4 layers, d 256, 4 heads, context 256, batch 16, fp32, on the embedded corpus
(byte vocabulary, 320). Peak RSS is not compared here (one process holds both); docs/performance.md
accounts for it.

Usage: python benchmarks/nanogpt_bench.py --nanogpt PATH [--rounds N] [--steps N] [--quick] [overrides...]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
from pathlib import Path

import torch
from bench import CHUNK, overhead_samples, paired_ratios, paired_run, raw_step, setup, verdict
from bench import interval as paired_interval
from bench import ratio as ratio_of_medians

from steadylm.schedule import set_lr

SHAPE = ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.context_length=256", "data.batch_size=16"]


def load(path: Path):
    """nanoGPT's model.py from a checkout, under a name of its own (its `model` would shadow nothing here)."""
    file = path / "model.py"
    if not file.is_file():
        raise SystemExit(f"error: --nanogpt {path}: no model.py there (git clone https://github.com/karpathy/nanoGPT)")
    spec = importlib.util.spec_from_file_location("nanogpt_model", file)
    nano = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nano)
    return nano


def nanogpt(nano, cfg):
    """nanoGPT's GPT at cfg's shape and its own AdamW groups."""
    m, o = cfg.model, cfg.optim
    net = nano.GPT(
        nano.GPTConfig(
            block_size=m.context_length,
            vocab_size=m.vocab_size,
            n_layer=m.n_layer,
            n_head=m.n_head,
            n_embd=m.d_model,
            dropout=0.0,
            bias=m.bias,
        )
    )
    opt = net.configure_optimizers(o.weight_decay, o.lr, tuple(o.betas), "cpu")
    return net, opt


def nanogpt_step(net, opt, lr, batch, clip: float | None) -> None:
    """nanoGPT's train.py step (one micro-step, no GradScaler: fp32)."""
    x, y = batch
    _, loss = net(x, y)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
    set_lr(opt, lr())
    opt.step()
    opt.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout (its model.py is imported)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes for the test suite; numbers are not meaningful")
    ap.add_argument("--rounds", type=int, default=4, help="trainer.fit runs (and model-only blocks per side)")
    ap.add_argument("--steps", type=int, default=40, help="timed steps per run")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides after the default shape, e.g. data.batch_size=8")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 1, CHUNK
        SHAPE[:] = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context_length=32"]
    if args.rounds < 1 or args.steps < CHUNK:
        ap.error(f"--rounds must be >= 1 and --steps >= {CHUNK} (the bootstrap resamples runs of {CHUNK} steps)")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    nano_module = load(args.nanogpt)
    cfg, module, datamodule, raw = setup(args.quick, [*SHAPE, *args.overrides])
    net, opt = nanogpt(nano_module, cfg)

    def nano() -> None:
        nanogpt_step(net, opt, raw.sched, next(raw.batches), raw.clip)

    print(f"whole step: {args.rounds} runs of {args.steps} steps, each paired with a nanoGPT step …", file=sys.stderr)
    runs = [paired_run(cfg, module, datamodule, nano, args.steps, r) for r in range(args.rounds)]
    t = overhead_samples(runs)
    print("model only: plain steps, a pair at a time in random order …", file=sys.stderr)
    pairs = paired_ratios(lambda: raw_step(module, raw.opt, raw.sched, next(raw.batches), raw.clip), nano, args.steps)
    tokens = datamodule.batch_size * datamodule.context_length
    rows = {
        "whole step, suite on (Lightning + default callbacks)": (t["on"], t["raw"]),
        "whole step, suite off (callbacks=minimal's steps)": (t["off"], t["raw"]),
    }
    shape = f"L{cfg.model.n_layer} d{cfg.model.d_model} T{cfg.model.context_length} B{cfg.data.batch_size}, fp32"
    print(f"\nsteadylm / nanoGPT step time ({shape}, {torch.get_num_threads()} threads; < 1: steadylm is faster)")
    print(f"{'':54} {'ratio':>6}  {'90% interval':>15}  target  verdict")
    results = {}
    for name, (a, b) in rows.items():
        value, (low, high) = ratio_of_medians(a, b), paired_interval(a, b)
        results[name] = {"ratio": value, "interval": [low, high]}
        print(f"{name:54} {value:6.3f}  [{low:.3f}, {high:.3f}]  <= 1.0  {verdict(low, high, 1.0)}")
    value, low, high, _, _ = pairs
    results["model + optimizer only (plain loops)"] = {"ratio": value, "interval": [low, high]}
    print(
        f"{'model + optimizer only (plain loops, paired steps)':54} {value:6.3f}  [{low:.3f}, {high:.3f}]  <= 1.0  {verdict(low, high, 1.0)}"
    )
    for name, a in (("steadylm (suite on)", t["on"]), ("nanoGPT", t["raw"])):
        ms = 1e3 * sorted(x[0] for block in a for x in block)[sum(map(len, a)) // 2]
        print(f"  {name:20} {ms:8.1f} ms/step  {tokens / ms * 1e3:9,.0f} tokens/s")
    return results


if __name__ == "__main__":
    main()
