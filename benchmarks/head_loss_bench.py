"""What the chunked head + loss saves and costs: peak memory and step time of forward + backward of the output head
and cross-entropy, plain (`optim.loss=plain`: whole logits) against chunked (the default, `optim.loss_chunk` tokens
at a time), side by side in one process on the CPU.

Each case feeds the head's input (tokens x d, fp32, requiring grad) and a weight (vocab x d) through the loss and
its backward, as `LMModule.head_loss` does after the trunk. Peak memory: the process's peak resident set above
what it held just before (Linux `VmHWM`, reset through /proc/self/clear_refs; tensors this size are their own
mappings, returned to the OS when freed), the smallest of `--mem-runs`. Step time: pairs of steps in a seeded
random order (a busy neighbour slows both sides alike); the median of the pairs' ratios with a 90 % bootstrap
interval, against the goals: peak at least 3x lower at GPT-2 small's shape, step time within 5 %.

  gpt2   GPT-2 small's head: vocab 50304, d 768, batch 4 x 1024 tokens
  128k   a Llama-3-sized vocabulary (128256) at the same width and batch
  --quick: 2 x 1024 tokens, 4 pairs; --pairs 0: memory only

Usage: python benchmarks/head_loss_bench.py [--quick] [--pairs N] [--chunk TOKENS] [--threads N] [--only gpt2|128k]
       [--tokens N] [--d D]
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from bench import paired_ratios  # noqa: E402

from steadylm.model.gpt import chunked_head_loss  # noqa: E402

MEMORY_GOAL, TIME_GOAL = 3.0, 0.05


def status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def peak_bytes(step) -> int:
    """Peak resident memory of `step()` above what the process held before it."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    before = status("VmRSS")
    step()
    return status("VmHWM") - before


def case(vocab: int, d: int, tokens: int, chunk: int, pairs: int, mem_runs: int) -> dict:
    torch.manual_seed(0)
    hidden = torch.randn(tokens, d, requires_grad=True)
    weight = (torch.randn(vocab, d) * 0.02).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,))

    def plain() -> None:
        logits = F.linear(hidden, weight)
        F.cross_entropy(logits.float(), targets, ignore_index=-100).backward()
        hidden.grad = weight.grad = None

    def chunked() -> None:
        chunked_head_loss(hidden, weight, targets, chunk=chunk)[0].backward()
        hidden.grad = weight.grad = None

    mem = {name: min(peak_bytes(f) for _ in range(mem_runs)) for name, f in (("plain", plain), ("chunked", chunked))}
    nan = float("nan")
    ratio, low, high, t_chunked, t_plain = paired_ratios(chunked, plain, pairs) if pairs else (nan,) * 5
    return dict(mem=mem, ratio=ratio, low=low, high=high, t_plain=t_plain, t_chunked=t_chunked)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--pairs", type=int, default=None, help="timed pairs per case")
    parser.add_argument("--mem-runs", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=1024, help="optim.loss_chunk")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", choices=("gpt2", "128k"))
    parser.add_argument("--tokens", type=int, default=None, help="tokens per step (default 4 x 1024)")
    parser.add_argument("--d", type=int, default=768, help="the head's input width")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokens = args.tokens or (2 if args.quick else 4) * 1024
    cases = {"gpt2": (50304, args.d, tokens), "128k": (128256, args.d, tokens)}
    pairs = args.pairs if args.pairs is not None else (4 if args.quick else 10)
    print(
        f"head + cross-entropy, forward + backward, plain vs chunked ({args.chunk} tokens), CPU, "
        f"{args.threads} thread(s), {pairs} pairs"
    )
    print(
        f"{'case':5} {'vocab x d, tokens':22} {'plain GiB':>9} {'chunked GiB':>11} {'peak /':>7} "
        f"{'plain s':>8} {'chunked s':>9} {'time ratio':>10}  90% interval"
    )
    for name, (vocab, d, tokens) in cases.items():
        if args.only and name != args.only:
            continue
        r = case(vocab, d, tokens, args.chunk, pairs, args.mem_runs)
        fall = r["mem"]["plain"] / r["mem"]["chunked"]
        mem_verdict = f"memory {'met' if fall >= MEMORY_GOAL else 'missed'}"
        time_verdict = "met" if r["high"] - 1 <= TIME_GOAL else "missed" if r["low"] - 1 > TIME_GOAL else "unresolved"
        print(
            f"{name:5} {f'{vocab} x {d}, {tokens}':22} {r['mem']['plain'] / 2**30:9.2f} "
            f"{r['mem']['chunked'] / 2**30:11.2f} {fall:6.1f}x {r['t_plain']:8.2f} {r['t_chunked']:9.2f} "
            f"{r['ratio']:10.3f}  [{r['low']:.3f}, {r['high']:.3f}]  {mem_verdict} (>= {MEMORY_GOAL:.0f}x), "
            f"time {time_verdict} (<= {1 + TIME_GOAL:.2f})"
        )


if __name__ == "__main__":
    main()
