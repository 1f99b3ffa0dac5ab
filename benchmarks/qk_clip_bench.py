"""What the default QK-clip costs: a step that measures per-head max logits and runs the policy / a plain step.

`callbacks.stability.qk_clip` (every_n_steps=1 by default) switches on the attention's explicit QK^T on one sequence
for the step's forward, stacks the per-head maxima, clips on the device (`QKClip.clip`; on a CPU, where a read
is free, only when a head is over tau), copies them to the host and accounts for them a step later
(`QKClip.account`), as `Stability.clip_logits` does. This times that against the same step without it, on
one model, fused AdamW, random tokens (a healthy model: no head over tau), step by step in a seeded random
order within each pair (a busy neighbour slows both sides alike), and prints the median of the pairs' ratios
with a 90 % bootstrap interval against the 2 % target, per preset:

  tiny       the tiny preset at its own context (128), batch 16
  small      GPT-2 small's width (768, 12 heads) at its context (1024), batch 8; --quick: 2 layers, context 256

Usage: python benchmarks/qk_clip_bench.py [--quick] [--steps N] [--device cpu|cuda] [--only tiny|small]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from bench import paired_ratios  # noqa: E402

from steadylm.model import GPT, GPTConfig  # noqa: E402
from steadylm.stability.qk_clip import QKClip  # noqa: E402

TARGET = 0.02


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench(model_cfg: dict, batch: int, steps: int, device: str) -> tuple[float, float, float, float, float]:
    torch.manual_seed(0)
    net = GPT(GPTConfig(**model_cfg)).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    attns = [b.attn for b in net.blocks]
    policy = QKClip()
    T, V = model_cfg["context_length"], model_cfg["vocab_size"]
    x = torch.randint(0, V, (batch, T), device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")

    def step(measure: bool) -> float:
        sync(device)
        start = time.perf_counter()
        for a in attns:
            a.track_max_logit = measure
        with autocast:
            logits = net(x)
        torch.nn.functional.cross_entropy(logits.float().view(-1, V), x.view(-1)).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if measure:  # what Stability.clip_logits does after the step: clip on the device, account a step late
            head_max = torch.stack([a.head_max_logit.float() for a in attns])
            policy.clip(head_max, attns)
            if pending:
                policy.account(0, list(pending.pop()))
            pending.append(head_max.to("cpu", non_blocking=True))
        sync(device)
        return time.perf_counter() - start

    pending: list[torch.Tensor] = []  # the host copy of the last measured step's logits
    ratio, low, high, with_, without = paired_ratios(lambda: step(True), lambda: step(False), steps)
    return with_, without, ratio, low, high


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None, help="steps per side")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--only", choices=("tiny", "small"))
    args = parser.parse_args()
    tiny = dict(n_layer=2, n_head=4, d_model=128, context_length=128, vocab_size=320)
    small = dict(n_layer=12, n_head=12, d_model=768, context_length=1024, vocab_size=50304)
    presets = {"tiny": (tiny, 16), "small": (small, 8)}
    if args.quick:
        presets["small"] = ({**small, "n_layer": 2, "context_length": 256, "vocab_size": 8192}, 4)
    steps = args.steps or (20 if args.quick else 60)
    print(f"qk_clip measurement + policy, every step, vs a plain step ({args.device}, {steps} steps per side)")
    print(f"{'preset':6} {'shape':32} {'plain ms':>9} {'with ms':>9} {'ratio':>7}  90% interval   target {TARGET:.0%}")
    for name, (cfg, batch) in presets.items():
        if args.only and name != args.only:
            continue
        with_, without, ratio, low, high = bench(cfg, batch, steps, args.device)
        shape = f"L{cfg['n_layer']} d{cfg['d_model']} T{cfg['context_length']} B{batch}"
        verdict = "met" if high - 1 <= TARGET else "missed" if low - 1 > TARGET else "unresolved"
        print(
            f"{name:6} {shape:32} {without * 1e3:9.2f} {with_ * 1e3:9.2f} {ratio:7.3f}  "
            f"[{low:.3f}, {high:.3f}]  {verdict}"
        )


if __name__ == "__main__":
    main()
