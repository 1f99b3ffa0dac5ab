"""What activation checkpointing saves and costs: peak memory and step time of one training step (forward, backward,
AdamW) under `model.activation_checkpointing` none, selective and blocks, side by side.

Each mode runs in a process of its own (a fresh allocator): the peak is that process's resident memory during the
steps less its resident memory before the first (weights, gradients, AdamW state and the batch are allocated first,
so the difference is the activations and their recompute); the time is the median of `--steps` steps after one
warm-up. On a GPU (`--device cuda`) the peak is `torch.cuda.max_memory_allocated` over the same steps.
Usage: python benchmarks/recompute_bench.py [--model small] [--batch 16] [--context 1024] [--steps 5] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import torch

MODES = ("none", "selective", "blocks")


def one_mode(args) -> dict:
    """Run in a process of its own: one mode's peak and step time."""
    from steadylm.config import compose
    from steadylm.model import GPT, GPTConfig

    torch.manual_seed(0)
    overrides = [f"model={args.model}", f"model.context_length={args.context}", "model.vocab_size=320"]
    model = dict(compose(overrides).model)
    net = GPT(GPTConfig(**{**model, "activation_checkpointing": args.mode})).to(args.device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x = torch.randint(0, 320, (args.batch, args.context), device=args.device)
    for p in net.parameters():  # gradients and AdamW state exist before the baseline
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=False)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        net(x).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"mode": args.mode, "peak_mib": (peak - before) / 2**20, "step_s": statistics.median(times[1:])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)  # a worker's
    args = ap.parse_args()
    if args.mode:
        print(json.dumps(one_mode(args)))
        return
    rows = []
    for mode in MODES:
        argv = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    base = rows[0]
    print(f"model={args.model} batch {args.batch} x {args.context} tokens, {args.device}")
    print(f"{'mode':10} {'peak MiB':>9} {'vs none':>8} {'step s':>8} {'vs none':>8}")
    for r in rows:
        mem, step = r["peak_mib"] / base["peak_mib"], r["step_s"] / base["step_s"]
        print(f"{r['mode']:10} {r['peak_mib']:9.0f} {mem:8.2f} {r['step_s']:8.2f} {step:8.2f}")


if __name__ == "__main__":
    main()
