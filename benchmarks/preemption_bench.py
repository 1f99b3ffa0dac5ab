"""What agreeing on the preemption flag costs per step under DDP: two CPU processes over gloo.

`steadylm.preemption.CollectiveFlag.poll` starts an async all-reduce of one int on a host-side gloo group
and reads the previous one. Per step this times, side by side in one run of two ranks:

  step     one training step of the tiny preset (forward, backward, AdamW; DDP's gradient all-reduce
           over the same gloo backend), the work each poll rides on
  poll     `poll` placed after each such step (what the run pays; `every_n_steps=1`)
  blocking the same all-reduce waited on at once (the naive version, for comparison)

and prints poll / step and blocking / step. Usage: python benchmarks/preemption_bench.py [--steps N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from steadylm.model import GPT, GPTConfig  # noqa: E402
from steadylm.preemption import CollectiveFlag  # noqa: E402


def worker(rank: int, steps: int, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(
        GPT(GPTConfig(n_layer=2, n_head=4, d_model=128, context_length=128, vocab_size=320))
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 320, (8, 129))
    flag = CollectiveFlag()
    flag.setup()

    def step() -> None:
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = {"step": [], "poll": [], "blocking": []}
    for i in range(steps + 5):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        flag.poll(0)
        t2 = time.perf_counter()
        buffer = torch.zeros(1, dtype=torch.int32)
        dist.all_reduce(buffer, op=dist.ReduceOp.MAX, group=flag.group)
        t3 = time.perf_counter()
        if i >= 5:  # warm-up
            times["step"].append(t1 - t0)
            times["poll"].append(t2 - t1)
            times["blocking"].append(t3 - t2)
    flag.wait()
    if rank == 0:
        out.update({k: statistics.median(v) for k, v in times.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(args.steps, 29000 + os.getpid() % 1000, out), nprocs=2)
        r = dict(out)
    print(f"2 CPU ranks (gloo), tiny preset, median of {args.steps} steps:")
    print(f"  step      {r['step'] * 1e3:8.2f} ms")
    print(f"  poll      {r['poll'] * 1e6:8.1f} us   poll / step     {r['poll'] / r['step']:.4f}")
    print(f"  blocking  {r['blocking'] * 1e6:8.1f} us   blocking / step {r['blocking'] / r['step']:.4f}")


if __name__ == "__main__":
    main()
