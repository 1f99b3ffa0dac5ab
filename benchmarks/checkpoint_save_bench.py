"""What a distributed checkpoint's save costs training under FSDP2: `async_save` true against false, side by side.

Two CPU processes (gloo) shard a preset's model with `fully_shard` per block and at the root, as `trainer=fsdp`
does, and give AdamW its state; then, in alternating rounds, each saves weights and optimizer state as the strategy
does (sharded_save.py, Lightning's state dicts) and runs `--steps` training steps:

  stall   how long the save call holds training up: the whole write when synchronous; the copy of each rank's
          shards to host memory when asynchronous
  steps   the time of the steps that follow, divided by the same steps' time with no save in flight: what the
          background write takes from training (on a CPU it shares the cores; on a GPU, host memory and the disk)

Printed: the medians, and async/sync stall with a 90 % bootstrap interval over rounds. On a GPU the same script
runs with `--device cuda` (one process per GPU, NCCL for training, gloo for the save's own group).
Usage: python benchmarks/checkpoint_save_bench.py [--quick] [--model small] [--rounds 5] [--steps 3] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from steadylm import sharded_save  # noqa: E402


def build(args):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from steadylm.config import compose
    from steadylm.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = dict(compose([f"model={args.model}", f"model.context_length={args.context}", "model.vocab_size=320"]).model)
    net = GPT(GPTConfig(**model)).to(args.device)
    mesh = init_device_mesh(args.device, (2,))
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    x = torch.randint(0, 320, (args.batch, args.context), device=args.device)

    def step() -> None:
        net(x).float().logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()

    def state() -> dict:  # what Lightning's ModelParallelStrategy hands `save_checkpoint`
        options = StateDictOptions(cpu_offload=True)
        return {
            "state_dict": get_model_state_dict(net, options=options),
            "optimizer_0": get_optimizer_state_dict(net, opt, options=options),
        }

    step()
    return step, state


def clock() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def one_round(mode: str, step, state, path: Path, rank: int, group, steps: int) -> dict:
    """Save, run `steps` steps, let the save land, run `steps` more: the stall and the steps' slowdown."""
    began = clock()
    pending = sharded_save.start(state(), {}, path, rank, dist.barrier, group if mode == "async" else None)
    if mode == "sync":
        sharded_save.finish(pending, rank)
    saved = clock()
    for _ in range(steps):
        step()
    during = clock() - saved
    if mode == "async":
        sharded_save.finish(pending, rank)
    quiet_began = clock()
    for _ in range(steps):
        step()
    return {"mode": mode, "stall": saved - began, "steps": during / (clock() - quiet_began)}


def rank_main(rank: int, args, folder: str, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=2)
    group = dist.new_group(backend="gloo")
    step, state = build(args)
    rows = []
    for r in range(args.rounds):
        for mode in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
            rows.append(one_round(mode, step, state, Path(folder) / f"{mode}.ckpt", rank, group, args.steps))
    if rank == 0:
        out["rows"] = rows
    dist.destroy_process_group()


def interval(sync: list[float], asyn: list[float], resamples: int = 1000) -> tuple[float, float]:
    rng, n, ratios = random.Random(0), len(sync), []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        ratios.append(statistics.median(asyn[i] for i in pick) / statistics.median(sync[i] for i in pick))
    ratios.sort()
    return ratios[int(0.05 * resamples)], ratios[int(0.95 * resamples) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--port", type=int, default=29547)
    ap.add_argument("--quick", action="store_true", help="the tiny preset at a 64-token context, 3 rounds")
    args = ap.parse_args()
    if args.quick:
        args.model, args.context, args.rounds = "tiny", 64, 3
    with tempfile.TemporaryDirectory(prefix="steadylm-save-") as folder, mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(rank_main, args=(args, folder, out), nprocs=2)
        rows = out["rows"]
    by = {m: [r for r in rows if r["mode"] == m] for m in ("sync", "async")}
    print(f"model={args.model}, 2 ranks on {args.device}, {args.rounds} rounds; save then {args.steps} steps")
    for mode, rs in by.items():
        stall, steps = statistics.median(r["stall"] for r in rs), statistics.median(r["steps"] for r in rs)
        print(f"{mode:>5}: stall {stall:.3f} s (median), the steps after it x{steps:.2f} of steps without a save")
    sync, asyn = [r["stall"] for r in by["sync"]], [r["stall"] for r in by["async"]]
    low, high = interval(sync, asyn)
    print(
        f"async/sync stall {statistics.median(asyn) / statistics.median(sync):.2f} (90 % interval {low:.2f}-{high:.2f})"
    )


if __name__ == "__main__":
    main()
