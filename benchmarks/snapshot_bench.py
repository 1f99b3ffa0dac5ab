"""What the snapshots cost: snapshot time per step / step time, on the tiny and small presets.

`callbacks.stability.recovery` copies weights, optimizer state, RNG and the data position aside every
`every_n_steps` steps (default 25): on a GPU into pinned host buffers, asynchronously on the training stream;
on a CPU into a file that a background thread syncs and drops from the page cache (`--store`, as `store: auto`).
For each preset this times, on one model with fused AdamW and random tokens:

  step        the median plain training step (forward, backward, clip, update), synchronised
  snapshot    the median host time of one `capture` call (what the training loop waits for)
  paired      blocks of `every_n` steps with a snapshot at the first step vs without, interleaved;
              (with - without) / without is the cost the run pays, copies overlapping compute included

and prints `snapshot / (every_n * step)` and the paired ratio against the 2 % target.
`--quick` (CPU-sized): the tiny preset, plus the small preset's width and depth at a short context.
Usage: python benchmarks/snapshot_bench.py [--quick] [--every N] [--rounds N] [--device cpu|cuda] [--only tiny|small]
                                          [--store auto|memory|disk]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from steadylm.model import GPT, GPTConfig  # noqa: E402
from steadylm.stability.recovery import capture  # noqa: E402
from steadylm.stability.snapshot_store import HostBuffers, SnapshotFile  # noqa: E402

TARGET = 0.02


def preset(name: str, **overrides) -> dict:
    from steadylm.config import compose

    cfg = compose([f"model={name}", "trainer=cpu"]).model
    # A CPU preset's vocabulary comes from the shards at startup; here the bytes tokenizer's, padded.
    return {**OmegaConf.to_container(cfg, resolve=True), "vocab_size": cfg.vocab_size or 320, **overrides}


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench(name: str, model_cfg: dict, batch: int, every: int, rounds: int, device: str, store: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="steadylm-snapshot-") as tmp, ThreadPoolExecutor(1) as flusher:
        target = SnapshotFile(Path(tmp) / "snap.bin", flusher) if store == "disk" else HostBuffers()
        try:
            return _bench(name, model_cfg, batch, every, rounds, device, target)
        finally:
            target.close()


def _bench(name: str, model_cfg: dict, batch: int, every: int, rounds: int, device: str, target) -> dict:
    torch.manual_seed(0)
    net = GPT(GPTConfig(**model_cfg)).to(device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)
    T, V = model_cfg["context_length"], model_cfg["vocab_size"]
    x = torch.randint(0, V, (batch, T), device=device)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")
    trainer = SimpleNamespace(optimizers=[opt], global_step=0)
    pl_module = SimpleNamespace(
        parameters=net.parameters, buffers=net.buffers, applied_steps=lambda: trainer.global_step
    )

    def step() -> None:
        with autocast:
            logits = net(x)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, V), x.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        target.wait_written()  # a file's write overlaps forward and backward; the update waits for it (Stability)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(3):
        step()  # warm up: kernels, optimizer state
    snap = capture(trainer, pl_module, store=target)  # allocates the storage once, as a run's first snapshot does
    snap.store.wait()
    steps, snaps, with_, without = [], [], [], []
    for r in range(rounds):
        for snapshot_first in (True, False) if r % 2 == 0 else (False, True):
            sync(device)
            t0 = time.perf_counter()
            for i in range(every):
                if snapshot_first and i == 0:
                    s0 = time.perf_counter()
                    snap = capture(trainer, pl_module, store=snap.store)
                    snaps.append(time.perf_counter() - s0)
                s1 = time.perf_counter()
                step()
                if not snapshot_first:
                    sync(device)
                    steps.append(time.perf_counter() - s1)
            sync(device)
            snap.store.wait()
            (with_ if snapshot_first else without).append(time.perf_counter() - t0)
    step_t, snap_t = statistics.median(steps), statistics.median(snaps)
    paired = statistics.median(w / wo - 1 for w, wo in zip(with_, without))
    return {
        "preset": name,
        "store": target.kind,
        "params_M": sum(p.numel() for p in net.parameters()) / 1e6,
        "snapshot_MB": sum(t.nbytes for t in snap.store.read(copy=False)) / 2**20,
        "step_ms": step_t * 1e3,
        "snapshot_ms": snap_t * 1e3,
        "every": every,
        "ratio": snap_t / (every * step_t),
        "paired": paired,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="CPU-sized: tiny, and small's width/depth at context 64")
    ap.add_argument("--every", type=int, default=25, help="callbacks.stability.recovery.every_n_steps (default 25)")
    ap.add_argument("--rounds", type=int, default=None, help="paired blocks per preset (default 4 quick, 10 full)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--only", default=None, help="one preset: tiny or small")
    ap.add_argument(
        "--store", choices=("auto", "memory", "disk"), default="auto", help="auto: memory on cuda, else disk"
    )
    args = ap.parse_args(argv)
    if args.every < 1:
        ap.error("--every must be >= 1")
    store = args.store if args.store != "auto" else ("memory" if args.device == "cuda" else "disk")
    rounds = args.rounds or (4 if args.quick else 10)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    if args.quick:
        cases = [("tiny", preset("tiny"), 8), ("small@ctx64", preset("small", context_length=64), 2)]
        every = min(args.every, 10)
    else:
        cases = [("tiny", preset("tiny"), 32), ("small", preset("small"), 8)]
        every = args.every
    if args.only:
        cases = [c for c in cases if c[0].split("@")[0] == args.only]
    results = []
    print(
        f"snapshot cost on {args.device}, store {store}, a snapshot every {every} steps "
        f"(target <= {TARGET:.0%} of step time)"
    )
    for name, cfg, batch in cases:
        r = bench(name, cfg, batch, every, rounds, args.device, store)
        results.append(r)
        verdict = "met" if max(r["ratio"], r["paired"]) <= TARGET else "missed"
        print(
            f"  {name:12s} {r['params_M']:7.1f}M params  snapshot {r['snapshot_MB']:8.1f} MB  step {r['step_ms']:8.2f} ms  "
            f"capture {r['snapshot_ms']:7.2f} ms  capture/(every*step) {r['ratio']:6.2%}  paired {r['paired']:+6.2%}  {verdict}",
            flush=True,
        )
    return results


if __name__ == "__main__":
    main()
