"""Side-by-side speed ratios, measured in one process with interleaved rounds (`make bench`).

Absolute times on shared machines are noise; ratios of medians taken round-robin in one process are
not. Every comparison runs the *same* model object, data and optimizer, so the only difference
measured is the one named in the row:

  lightning+suite / raw loop   train.py's Lightning path with every stability callback vs a plain loop
  suite on / suite off         `callbacks=default` vs `callbacks=minimal`
  loader / training tokens/s   the real DataModule over real shards vs what training consumes
  bf16 / fp32 (CPU autocast)   and compile / eager

Each step-time ratio comes with a 90 % interval (bootstrap over rounds, each round resampled whole so
its blocks stay paired) and a verdict against its target: met (the whole interval is inside), missed
(the whole interval is outside) or unresolved (the machine's noise spans the target: run more rounds).

Usage: python benchmarks/bench.py [--quick] [--rounds N] [--steps N] [--json FILE] [--no-compile] [overrides...]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import lightning as L
import torch

from steadylm.config import compose, set_key
from steadylm.data.prepare import prepare
from steadylm.train import build, build_trainer

WARMUP = 3  # steps dropped from each timed block: allocator and autotuning settle there
Sample = tuple[float, float]  # one step: (wall, process CPU) seconds
Blocks = list[list[Sample]]  # one timed block per round


class StepTimer(L.Callback):
    """Time between consecutive batch starts: data, forward, backward, clip, step and every hook."""

    def __init__(self) -> None:
        self.starts: list[Sample] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.starts.append(now())

    def step_times(self) -> list[Sample]:
        return intervals(self.starts)[WARMUP:]


def now() -> Sample:
    """(wall, process CPU) seconds. CPU time leaves out the time this process waited for a core; a
    neighbour sharing the core's caches still slows both, so neither is noise-free."""
    return time.perf_counter(), time.process_time()


def intervals(stamps: list[Sample]) -> list[Sample]:
    return [(b[0] - a[0], b[1] - a[1]) for a, b in zip(stamps, stamps[1:])]


def lightning_block(cfg, module, datamodule, steps: int) -> list[Sample]:
    """One `trainer.fit` of `steps` steps on the shared module and data; set-up is not timed."""
    set_key(cfg, "trainer.max_steps", steps + 1)
    trainer = build_trainer(cfg)
    timer = StepTimer()
    trainer.callbacks.append(timer)
    trainer.fit(module, datamodule=datamodule)
    return timer.step_times()


def raw_block(module, opt, sched, loader_iter: Iterator, steps: int, *, autocast=False, forward=None) -> list[Sample]:
    """The plain PyTorch loop nanoGPT users would write: same model, data, optimizer and clipping."""
    forward = module.net if forward is None else forward
    stamps = [now()]
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    for _ in range(steps + 1):
        x, y = next(loader_iter)
        with ctx:
            loss, _ = module.loss(forward(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        stamps.append(now())
    return intervals(stamps)[WARMUP:]


def endless(loader) -> Iterator:
    while True:
        yield from loader


def median(blocks: Blocks, clock: int = 0) -> float:
    return statistics.median(x[clock] for block in blocks for x in block)


def ratio(a: Blocks, b: Blocks, clock: int = 0) -> float:
    """Ratio of medians over every step of every round; clock 0 = wall time, 1 = process CPU time."""
    return median(a, clock) / median(b, clock)


def interval(a: Blocks, b: Blocks, clock: int = 0, resamples: int = 1000) -> tuple[float, float]:
    """90 % bootstrap interval of `ratio(a, b)`, resampling whole rounds.

    Rounds are the unit because steps within a block share the machine's state of that moment (a busy
    neighbour slows a whole block), and a and b are resampled with the same rounds because they ran
    side by side. Seeded: the same samples always give the same interval.
    """
    rng = random.Random(0)
    n = len(a)
    values = sorted(
        ratio([a[i] for i in pick], [b[i] for i in pick], clock)
        for pick in ([rng.randrange(n) for _ in range(n)] for _ in range(resamples))
    )
    return values[int(0.05 * resamples)], values[int(0.95 * resamples) - 1]


def verdict(low: float, high: float, limit: float) -> str:
    if high <= limit:
        return "met"
    return "missed" if low > limit else "unresolved"


def interleave(rounds: int, runners: dict[str, Callable[[], list[Sample]]]) -> dict[str, Blocks]:
    """Round-robin the runners, rotating who goes first, so drift in machine load hits every side equally.

    The garbage collector is paused inside each block (as `timeit` does): a collection triggered by one
    variant's allocations would otherwise land in whichever block happens to be running.
    """
    samples: dict[str, Blocks] = {name: [] for name in runners}
    names = list(runners)
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            gc.collect()
            gc.disable()
            try:
                samples[name].append(runners[name]())
            finally:
                gc.enable()
        print(f"  round {r + 1}/{rounds} done", file=sys.stderr)
    return samples


def suite_hook_share(suite_cfg, bare_cfg, module, datamodule, steps: int) -> float:
    """Time inside the suite's own callback hooks / step time, from Lightning's SimpleProfiler.

    An attribution rather than a difference of two noisy medians: on a shared machine the ratio rows
    scatter by several percent between runs, this one by a fraction of a percent.
    """
    from lightning.pytorch.profilers import SimpleProfiler

    suite = {n["_target_"].rsplit(".", 1)[-1] for n in suite_cfg.callbacks.values() if n}
    suite -= {n["_target_"].rsplit(".", 1)[-1] for n in bare_cfg.callbacks.values() if n}
    set_key(suite_cfg, "trainer.max_steps", steps + 1)
    trainer = build_trainer(suite_cfg)
    trainer.profiler = profiler = SimpleProfiler()
    trainer.fit(module, datamodule=datamodule)
    d = profiler.recorded_durations
    in_suite = sum(sum(v) for k, v in d.items() if k.startswith("[Callback]") and k[10:].split(".")[0].split("{")[0] in suite)
    return in_suite / sum(d["run_training_batch"])


def loader_tokens_per_sec(datamodule, batches: int) -> float:
    loader = datamodule.train_dataloader()
    it = endless(loader)
    next(it)
    t0, tokens = time.perf_counter(), 0
    for _ in range(batches):
        x, _ = next(it)
        tokens += x.numel()
    return tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes for the test suite; numbers are not meaningful")
    ap.add_argument("--rounds", type=int, default=12, help="interleaved rounds for the step-time ratios")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per block")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile row (compiling takes a while)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model.d_model=256")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.no_compile = 2, 6, True
    logging.getLogger("lightning").setLevel(logging.WARNING)

    work = Path(tempfile.mkdtemp(prefix="steadylm-bench-"))
    data_dir = work / "data"
    prepare(input=None, out_dir=data_dir, max_bytes=300_000 if args.quick else 3_000_000, progress=False)
    common = [
        "trainer=cpu", f"data.dir={data_dir}", f"paths.output_dir={work / 'run'}", "logger=none",
        "trainer.enable_progress_bar=false", "trainer.limit_val_batches=0", "trainer.enable_model_summary=false",
        "trainer.val_check_interval=1000000", "optim.warmup_steps=1",
        "trainer.max_steps=100000", *args.overrides,
    ]
    suite_cfg = compose([*common, "callbacks=default", "~callbacks.checkpoint"])
    bare_cfg = compose([*common, "callbacks=minimal", "~callbacks.checkpoint"])
    objects = build(suite_cfg)
    module, datamodule = objects["module"], objects["datamodule"]
    opt_cfg = module.configure_optimizers()
    opt, sched = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    batches = endless(datamodule.train_dataloader())

    def raw(steps: int, **kw) -> Callable[[], list[Sample]]:
        return lambda: raw_block(module, opt, sched, batches, steps, **kw)

    steps = args.steps
    print(f"step time: {args.rounds} interleaved rounds of {steps} steps each …", file=sys.stderr)
    t = interleave(args.rounds, {
        "raw": raw(steps),
        "suite": lambda: lightning_block(suite_cfg, module, datamodule, steps),
        "bare": lambda: lightning_block(bare_cfg, module, datamodule, steps),
    })
    # bf16 and compile change a step several-fold (or not at all): two short rounds resolve that.
    kernels = {"fp32": raw(max(2, steps // 2)), "bf16": raw(max(2, steps // 2), autocast=True)}
    if not args.no_compile:
        compiled = torch.compile(module.net)
        raw_block(module, opt, sched, batches, 2, forward=compiled)  # compile outside the timed rounds
        kernels["compiled"] = raw(max(2, steps // 2), forward=compiled)
    print("kernels: bf16 / compile …", file=sys.stderr)
    k = interleave(2, kernels)

    tokens_per_step = datamodule.batch_size * datamodule.context_length
    train_tps = tokens_per_step / median(t["suite"])
    fpt = module.net.flops_per_token()
    results = {
        "lightning_suite_over_raw": ratio(t["suite"], t["raw"]),
        "suite_on_over_off": ratio(t["suite"], t["bare"]),
        "lightning_suite_over_raw_cpu": ratio(t["suite"], t["raw"], clock=1),
        "suite_on_over_off_cpu": ratio(t["suite"], t["bare"], clock=1),
        "intervals": {
            "lightning_suite_over_raw": interval(t["suite"], t["raw"]),
            "suite_on_over_off": interval(t["suite"], t["bare"]),
            "lightning_suite_over_raw_cpu": interval(t["suite"], t["raw"], clock=1),
            "suite_on_over_off_cpu": interval(t["suite"], t["bare"], clock=1),
        },
        "overhead_ms_per_step": 1e3 * (median(t["suite"]) - median(t["raw"])),
        "suite_hook_share_of_step": suite_hook_share(suite_cfg, bare_cfg, module, datamodule, 3 * steps),
        "loader_over_training_tokens_per_sec": loader_tokens_per_sec(datamodule, 20 if args.quick else 200) / train_tps,
        "bf16_over_fp32_cpu": ratio(k["bf16"], k["fp32"]),
        "compiled_over_eager": ratio(k["compiled"], k["fp32"]) if "compiled" in k else None,
        "flops_per_token": fpt,
        "train_tokens_per_sec": train_tps,
        "model_flops_per_sec": fpt * train_tps,
        "params": module.net.num_params(),
        "step_ms": 1e3 * median(t["raw"]),
        "rounds": args.rounds,
        "steps_per_block": steps,
        "threads": torch.get_num_threads(),
    }
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


def report(r: dict) -> None:
    limit = 1.02
    print(f"\n{'ratio of medians (interleaved)':40} {'value':>7}  {'90% interval':>15}  target   verdict")
    for name, key in [
        ("step time: Lightning + suite / raw loop", "lightning_suite_over_raw"),
        ("step time: suite on / suite off", "suite_on_over_off"),
        ("CPU time: Lightning + suite / raw loop", "lightning_suite_over_raw_cpu"),
        ("CPU time: suite on / suite off", "suite_on_over_off_cpu"),
    ]:
        low, high = r["intervals"][key]
        print(f"{name:40} {r[key]:7.3f}  [{low:.3f}, {high:.3f}]  <= {limit}  {verdict(low, high, limit)}")
    share, loader = r["suite_hook_share_of_step"], r["loader_over_training_tokens_per_sec"]
    print(f"{'suite hook time / step time (profiler)':40} {share:7.3f}  {'':15}  <= 0.02  {'met' if share <= 0.02 else 'missed'}")
    print(f"{'tokens/s: data loader / training':40} {loader:7.1f}  {'':15}  >= 50    {'met' if loader >= 50 else 'missed'}")
    print(f"{'step time: bf16 autocast / fp32 (CPU)':40} {r['bf16_over_fp32_cpu']:7.3f}  {'':15}  < 1 where the CPU has bf16 units")
    compiled = r["compiled_over_eager"]
    print(f"{'step time: torch.compile / eager':40} {'skipped' if compiled is None else f'{compiled:7.3f}':>7}  {'':15}  < 1")
    print(f"\nmodel: {r['params']:,} params, {r['flops_per_token']:,} FLOPs/token (6N + 12·L·d·T)")
    print(f"raw step {r['step_ms']:.1f} ms on {r['threads']} threads; Lightning + suite adds {r['overhead_ms_per_step']:+.2f} ms")
    print(f"training: {r['train_tokens_per_sec']:,.0f} tokens/s = {r['model_flops_per_sec'] / 1e9:.2f} GFLOP/s achieved")
    print(f"{r['rounds']} rounds x {r['steps_per_block']} steps; 'unresolved' = noise spans the target: run more --rounds")


if __name__ == "__main__":
    main()
