"""What skipping PyTorch's discarded default init saves when building a model (`steadylm.model.init.layer`).

Builds the preset's `GPT` (its `model.init`, on the CPU) twice per round, side by side: as `train.py` does,
and with each Linear/Embedding first drawn by PyTorch's own default init, then overwritten by
`init_weights` (what building did before). Prints both times and their ratio.
Usage: python benchmarks/build_bench.py [--preset llama_1b] [--rounds 2] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from omegaconf import OmegaConf

from steadylm.config import compose
from steadylm.model import GPT, GPTConfig, attention, gpt


def with_default_draw(cls, init, *args, **kwargs):
    return cls(*args, **kwargs)


def build_seconds(fields: dict, patched: bool) -> float:
    modules = (attention, gpt)
    kept = [m.layer for m in modules]
    if patched:
        for m in modules:
            m.layer = with_default_draw
    try:
        torch.manual_seed(0)
        start = time.perf_counter()
        model = GPT(GPTConfig(**fields))
        seconds = time.perf_counter() - start
        del model
        return seconds
    finally:
        for m, f in zip(modules, kept):
            m.layer = f


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama_1b")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fields = OmegaConf.to_container(compose([f"model={args.preset}"]).model, resolve=True)
    fields["vocab_size"] = fields["vocab_size"] or 320  # a CPU preset's comes from the shards: the bytes tokenizer's
    fresh, drawn = [], []
    for r in range(args.rounds):  # the order alternates: the first build of a process also faults its pages in
        for patched in (r % 2 == 1, r % 2 == 0):
            (drawn if patched else fresh).append(build_seconds(fields, patched))
    f, d = statistics.median(fresh), statistics.median(drawn)
    print(f"model={args.preset} (init={fields.get('init', 'gpt2')}), {args.threads} threads, {args.rounds} rounds")
    print(f"build, default draw skipped  {f:7.2f} s")
    print(f"build, default draw first    {d:7.2f} s")
    print(f"ratio skipped / first        {f / d:7.3f}")


if __name__ == "__main__":
    main()
