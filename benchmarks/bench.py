"""Side-by-side speed ratios, measured in one process (`make bench`).

Absolute times on shared machines are noise; ratios of medians of interleaved samples are not. The two
overhead ratios interleave at the finest grain there is, the step, inside one `trainer.fit` of
`train.py`'s Lightning path on the *same* model object, data and optimizer:

  lightning+suite / raw loop   after every Lightning step, one plain PyTorch step (same model, data,
                               optimizer recipe, clipping) runs and is timed on its own
  suite on / suite off         the stability callbacks run on a seeded random half of the steps; on
                               the other half the step is `callbacks=minimal`'s, plus Lightning's
                               dispatch to the suite's hooks (their gates return at once)
  Python calls per step        cProfile's count of function calls on ordinary steps: raw loop,
                               `callbacks=minimal`, full suite (dispatch included); noise-free; and
                               how many steadylm functions an ordinary step calls
  loader / training tokens/s   the real DataModule over real shards vs what training consumes
  data.sources read cost       a mixture's loader against one source's, interleaved blocks, per batch, in step units
  bf16 / fp32 (CPU autocast)   and compile / eager: interleaved blocks of raw steps

A busy neighbour on a shared machine slows everything for seconds at a time; step-by-step pairs see the
same slowdown on both sides, where block-by-block runs of the same code scatter by ±5-25 %. Each step-time
ratio comes with a 90 % interval (bootstrap over runs of 10 consecutive steps) and a verdict against its
target: met (the whole interval is inside), missed (the whole interval is outside) or unresolved (the
noise spans the target: run more --rounds).

Usage: python benchmarks/bench.py [--quick] [--rounds N] [--steps N] [--json FILE] [--no-compile] [overrides...]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import gc
import itertools
import json
import logging
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import lightning as L
import torch
from omegaconf import read_write

from steadylm.config import compose
from steadylm.data.prepare import prepare
from steadylm.resolve import Resolved, fill
from steadylm.schedule import set_lr
from steadylm.train import build, build_trainer

WARMUP = 3  # steps dropped from each timed run: allocator, optimizer state and autotuning settle there
CHUNK = 10  # consecutive steps resampled together by the bootstrap: load drifts over seconds
SUITE = ("stability",)  # `callbacks=default` minus these = `callbacks=minimal`
Sample = tuple[float, float]  # one step: (wall, process CPU) seconds
Blocks = list[list[Sample]]  # samples grouped for the bootstrap; a and b share the grouping


def with_keys(run: Resolved, keys: dict) -> Resolved:
    """`run` with `keys` set in a read-only copy of its config, nothing derived again (Trainers of other lengths
    around one module and DataModule)."""
    cfg = copy.deepcopy(run.cfg)
    with read_write(cfg):
        fill(cfg, keys)
    return replace(run, cfg=cfg)


def now() -> Sample:
    """(wall, process CPU) seconds. CPU time leaves out the time this process waited for a core; a
    neighbour sharing the core's caches still slows both, so neither is noise-free. On a GPU it first waits for
    the queued work, so a stamp closes the step before it (both sides of a pair alike)."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
    return time.perf_counter(), time.process_time()


def since(start: Sample) -> Sample:
    t = now()
    return t[0] - start[0], t[1] - start[1]


def raw_step(module, opt, lr: Callable[[], float], batch, clip: float | None, *, autocast=False, forward=None) -> None:
    """One step of the plain loop nanoGPT users write: forward, loss, backward, clip, the LR, AdamW, zero (the batch on
    the model's device, bf16 autocast on that device when `autocast`)."""
    x, y = batch
    ctx = torch.autocast(x.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        loss, _ = module.loss((module.net if forward is None else forward)(x), y)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
    set_lr(opt, lr())
    opt.step()
    opt.zero_grad(set_to_none=True)


def raw_block(module, opt, lr, batches: Iterator, steps: int, clip: float | None, **kw) -> list[Sample]:
    samples = []
    for _ in range(steps + WARMUP):
        start = now()
        raw_step(module, opt, lr, next(batches), clip, **kw)
        samples.append(since(start))
    return samples[WARMUP:]


def paired_ratios(a: Callable[[], None], b: Callable[[], None], n: int, seed: int = 0) -> tuple[float, ...]:
    """(median of n paired step-time ratios a/b, its 90 % bootstrap interval, median a, median b), each pair in
    a seeded random order: a neighbour's load drifts over seconds, and a pair sees the same drift on both sides."""
    coin, ratios, times = random.Random(seed), [], {"a": [], "b": []}
    for _ in range(WARMUP):
        a(), b()
    for _ in range(n):
        t = {}
        for side, step in sorted((("a", a), ("b", b)), key=lambda _: coin.random()):
            start = time.perf_counter()
            step()
            t[side] = time.perf_counter() - start
            times[side].append(t[side])
        ratios.append(t["a"] / t["b"])
    rng = random.Random(seed + 1)
    boot = sorted(statistics.median(rng.choices(ratios, k=n)) for _ in range(1000))
    return statistics.median(ratios), boot[50], boot[949], statistics.median(times["a"]), statistics.median(times["b"])


class PairedSteps(L.Callback):
    """Times each Lightning step (batch start to next batch start) and, inside it, one raw step.

    The raw step runs at batch end and its time is taken out of the Lightning step it sits in, so
    sample i of `lightning` and of `raw` ran back to back. It must be the first callback: its stamp
    opens the step, then it tosses the seeded coin that the `Gate`s read for this step.
    """

    def __init__(self, raw: Callable[[], None], seed: int) -> None:
        self.raw, self.coin = raw, random.Random(seed)
        self.on = True
        self.lightning: list[Sample] = []
        self.raw_times: list[Sample] = []
        self.suite_on: list[bool] = []
        self._start: Sample | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self._start is not None:
            total, inner = since(self._start), self.raw_times[-1]
            self.lightning.append((total[0] - inner[0], total[1] - inner[1]))
        self._start = now()
        self.on = self.coin.random() < 0.5
        self.suite_on.append(self.on)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        pl_module.zero_grad(set_to_none=True)  # the raw step starts as it would alone, with no grads to add to
        start = now()
        with torch.enable_grad():
            self.raw()
        self.raw_times.append(since(start))

    def samples(self) -> tuple[list[Sample], list[Sample], list[bool]]:
        n = len(self.lightning)
        return self.lightning[WARMUP:], self.raw_times[WARMUP:n], self.suite_on[WARMUP:n]


class Gate(L.Callback):
    """Runs one stability callback's per-step hooks only on the steps `PairedSteps` tossed "on"."""

    def __init__(self, inner: L.Callback, paired: PairedSteps) -> None:
        self.inner, self.paired = inner, paired

    @property
    def state_key(self) -> str:
        return f"Gate[{self.inner.state_key}]"


def _forward(hook: str):
    def call(self, trainer, *args):
        if self.paired.on:
            getattr(self.inner, hook)(trainer, *args)

    return call


STEP_HOOKS = (
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
)
for _hook in STEP_HOOKS:
    setattr(Gate, _hook, _forward(_hook))


def endless(loader) -> Iterator:
    while True:
        yield from loader


def median(blocks: Blocks, clock: int = 0) -> float:
    return statistics.median(x[clock] for block in blocks for x in block)


def ratio(a: Blocks, b: Blocks, clock: int = 0) -> float:
    """Ratio of medians over every sample; clock 0 = wall time, 1 = process CPU time."""
    return median(a, clock) / median(b, clock)


def interval(a: Blocks, b: Blocks, clock: int = 0, resamples: int = 1000) -> tuple[float, float]:
    """90 % bootstrap interval of `ratio(a, b)`, resampling whole groups, the same ones on both sides.

    Groups are the unit because neighbouring steps share the machine's state of that moment; a and b
    are resampled together because they ran side by side. Seeded: the same samples give the same interval.
    """
    rng = random.Random(0)
    n = len(a)
    values = []
    for _ in range(resamples):
        pick = [rng.randrange(n) for _ in range(n)]
        ra, rb = [a[i] for i in pick], [b[i] for i in pick]
        if any(ra) and any(rb):
            values.append(ratio(ra, rb, clock))
    values.sort()
    return values[int(0.05 * len(values))], values[int(0.95 * len(values)) - 1]


def verdict(low: float, high: float, limit: float) -> str:
    if high <= limit:
        return "met"
    return "missed" if low > limit else "unresolved"


def suite_names(cfg) -> set[str]:
    """Class names of the stability callbacks in this config."""
    return {cfg.callbacks[n]["_target_"].rsplit(".", 1)[-1] for n in SUITE if cfg.callbacks.get(n)}


def paired_run(run: Resolved, module, datamodule, raw: Callable[[], None], steps: int, seed: int) -> PairedSteps:
    """One `trainer.fit` of `train.py`'s trainer, suite gated per step, a raw step inside each step."""
    trainer = build_trainer(with_keys(run, {"trainer.max_steps": steps + WARMUP + 1}))
    paired = PairedSteps(raw, seed)
    suite = suite_names(run.cfg)
    gated = [Gate(cb, paired) if type(cb).__name__ in suite else cb for cb in trainer.callbacks]
    trainer.callbacks = [paired, *gated]
    gc.collect()
    gc.disable()  # as `timeit` does: a collection would land in whichever step happens to run
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        gc.enable()
    return paired


def overhead_samples(runs: list[PairedSteps]) -> dict[str, Blocks]:
    """Per-step samples of every run, grouped by CHUNK consecutive steps: suite on, suite off, raw."""
    groups: dict[str, Blocks] = {"on": [], "off": [], "raw": []}
    for run in runs:
        lightning, raw, on = run.samples()
        for i in range(0, len(lightning), CHUNK):
            pairs = list(zip(lightning[i : i + CHUNK], raw[i : i + CHUNK], on[i : i + CHUNK]))
            groups["on"].append([step for step, _, o in pairs if o])
            groups["off"].append([step for step, _, o in pairs if not o])
            groups["raw"].append([r for _, r, _ in pairs])
    return groups


def interleave(rounds: int, runners: dict[str, Callable[[], list[Sample]]]) -> dict[str, Blocks]:
    """Round-robin blocks of the runners, rotating who goes first, GC paused inside each block."""
    samples: dict[str, Blocks] = {name: [] for name in runners}
    names = list(runners)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gc.collect()
            gc.disable()
            try:
                samples[name].append(runners[name]())
            finally:
                gc.enable()
    return samples


def suite_hook_share(run: Resolved, module, datamodule, steps: int) -> float:
    """Time inside the suite's own callback hooks / step time, from Lightning's SimpleProfiler."""
    from lightning.pytorch.profilers import SimpleProfiler

    suite = suite_names(run.cfg)
    trainer = build_trainer(with_keys(run, {"trainer.max_steps": steps + 1}))
    trainer.profiler = profiler = SimpleProfiler()
    trainer.fit(module, datamodule=datamodule)
    d = profiler.recorded_durations
    keys = tuple(f"[Callback]{cb.state_key}." for cb in trainer.callbacks if type(cb).__name__ in suite)
    in_suite = sum(sum(v) for k, v in d.items() if k.startswith(keys))
    return in_suite / sum(d["run_training_batch"])


SRC = str(Path(__file__).resolve().parents[1] / "src" / "steadylm")


def calls_per_step(run: Callable[[int], None], steps: int) -> tuple[float, set[tuple[str, str]]]:
    """Python function calls per step: cProfile's count over 2n steps minus over n, so setup cancels out; and the
    steadylm functions (file, name) called more often in 2n steps than in n: those of an ordinary step.

    A count, not a time: the same on every run, where this machine's noise hides hundreds of calls. It shows
    where a fixed per-step overhead comes from (Lightning's loop, its hook dispatch, the suite's bodies).
    """

    def count(n: int) -> tuple[int, dict]:
        profiler = cProfile.Profile()
        profiler.enable()
        try:
            run(n)
        finally:
            profiler.disable()
        stats = pstats.Stats(profiler)
        ours = {(f[len(SRC) + 1 :], name): v[1] for (f, _, name), v in stats.stats.items() if f.startswith(SRC)}
        return stats.total_calls, ours

    (once, few), (twice, more) = count(steps), count(2 * steps)
    return (twice - once) / steps, {f for f, n in more.items() if n > few.get(f, 0)}


def python_calls(run: Resolved, module, datamodule, raw: Callable[[], None], steps: int) -> dict[str, float]:
    """Calls per ordinary step (no logging step) of the raw loop, `callbacks=minimal` and the full suite."""
    suite = suite_names(run.cfg)
    quiet = {"trainer.log_every_n_steps": 10**9}  # the stats callback follows it: ordinary steps only

    def fit(with_suite: bool):
        def steps_of(n: int) -> None:
            trainer = build_trainer(with_keys(run, {**quiet, "trainer.max_steps": n}))
            if not with_suite:
                trainer.callbacks = [cb for cb in trainer.callbacks if type(cb).__name__ not in suite]
            trainer.fit(module, datamodule=datamodule)

        return steps_of

    def raw_steps(n: int) -> None:
        with torch.enable_grad():
            for _ in range(n):
                raw()

    suite_calls, functions = calls_per_step(fit(True), steps)
    return {
        "raw": calls_per_step(raw_steps, steps)[0],
        "minimal": calls_per_step(fit(False), steps)[0],
        "suite": suite_calls,
        "steadylm_functions": len(functions),
        "steadylm_files": len({f for f, _ in functions}),
    }


def loader_tokens_per_sec(datamodule, batches: int) -> float:
    it = endless(datamodule.train_dataloader())
    next(it)
    t0, tokens = time.perf_counter(), 0
    for _ in range(batches):
        x, _ = next(it)
        tokens += x.numel()
    return tokens / (time.perf_counter() - t0)


def mixture_read_share(datamodule, step_s: float, batches: int, rounds: int = 4) -> tuple[float, float, float]:
    """What reading `data.sources` adds to a step: (mixture's loader time - one source's) per batch / the training
    step, from interleaved blocks of each loader; the mixture is the same shards as two sources at 0.7 / 0.3."""
    from steadylm.data.datamodule import ShardDataModule

    keys = {"batch_size": datamodule.batch_size, "context_length": datamodule.context_length, "seed": 1}
    two = {"a": {"dir": datamodule.dir, "weight": 0.7}, "b": {"dir": datamodule.dir, "weight": 0.3}}
    mixed = ShardDataModule(dir=datamodule.dir, sources=two, **keys)

    def reader(dm):
        it = endless(dm.train_dataloader())
        next(it)

        def block() -> list[Sample]:
            samples = []
            for _ in range(batches):
                start = now()
                next(it)
                samples.append(since(start))
            return samples

        return block

    t = interleave(rounds, {"one": reader(ShardDataModule(dir=datamodule.dir, **keys)), "mixture": reader(mixed)})
    extra = (median(t["mixture"]) - median(t["one"])) / step_s
    low, high = interval(t["mixture"], t["one"])  # the loaders' own ratio: its spread, in step units below
    spread = median(t["one"]) / step_s
    return extra, (low - 1) * spread, (high - 1) * spread


class RawLoop:
    """The raw loop's own AdamW (the same recipe as Lightning's), its LR by its own step count, its batches (copied to
    the model's device, as Lightning copies its own), bf16 autocast when `autocast`."""

    def __init__(self, cfg, module, datamodule, autocast: bool = False) -> None:
        self.module, self.opt, self.autocast = module, module.configure_optimizers(), autocast
        steps = itertools.count()
        self.sched = lambda: module.schedule(next(steps))
        self.batches = endless(datamodule.train_dataloader())
        self.clip = cfg.trainer.gradient_clip_val  # the raw loop clips exactly as the Trainer does

    def __call__(self) -> None:
        batch = [t.to(self.module.device, non_blocking=True) for t in next(self.batches)]
        raw_step(self.module, self.opt, self.sched, batch, self.clip, autocast=self.autocast)


def setup(quick: bool, overrides: list[str]):
    """(the resolved run, module, datamodule, raw loop): `train.py`'s objects on fresh shards of the embedded corpus."""
    work = Path(tempfile.mkdtemp(prefix="steadylm-bench-"))
    data_dir = work / "data"
    prepare(input=None, out_dir=data_dir, max_bytes=300_000 if quick else 3_000_000, progress=False)
    cfg = compose(
        [
            "trainer=cpu",
            "trainer.precision=32-true",  # the raw loop's precision; `auto` would be bf16 on a CPU with bf16 units
            f"data.dir={data_dir}",
            f"paths.output_dir={work / 'run'}",
            "logger=none",
            "trainer.enable_progress_bar=false",
            "trainer.limit_val_batches=0",
            "trainer.enable_model_summary=false",
            "trainer.val_check_interval=1000000",
            "optim.warmup_steps=1",
            "trainer.max_steps=100000",
            # Two AdamWs (Lightning's and the raw loop's) share the weights: a low LR keeps them finite and
            # quiet, so every timed step takes the healthy path. Timing does not depend on the LR.
            "optim.lr=1e-4",
            "optim.min_lr=1e-5",
            "callbacks=default",
            "~callbacks.checkpoint",
            *overrides,
        ]
    )
    objects = build(cfg)
    module, datamodule = objects["module"], objects["datamodule"]
    return objects["run"], module, datamodule, RawLoop(cfg, module, datamodule)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes for the test suite; numbers are not meaningful")
    ap.add_argument("--rounds", type=int, default=5, help="trainer.fit runs for the overhead ratios")
    ap.add_argument("--steps", type=int, default=60, help="timed steps per run")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile row (compiling takes a while)")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model.d_model=256")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.no_compile = 1, 2 * CHUNK, True
    if args.rounds < 1 or args.steps < CHUNK:
        ap.error(f"--rounds must be >= 1 and --steps >= {CHUNK} (the bootstrap resamples runs of {CHUNK} steps)")
    # Lightning's own logger sets INFO on import: its per-fit banners and tips would bury the progress lines.
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)

    run, module, datamodule, raw = setup(args.quick, args.overrides)
    opt, sched, batches, clip = raw.opt, raw.sched, raw.batches, raw.clip

    print(f"overhead: {args.rounds} runs of {args.steps} steps, each paired with a raw step …", file=sys.stderr)
    runs = []
    for r in range(args.rounds):
        runs.append(paired_run(run, module, datamodule, raw, args.steps, r))
        print(f"  run {r + 1}/{args.rounds} done", file=sys.stderr)
    t = overhead_samples(runs)

    print("kernels: bf16 / compile …", file=sys.stderr)
    block = max(2, args.steps // 4)
    kernels = {
        "fp32": lambda: raw_block(module, opt, sched, batches, block, clip),
        "bf16": lambda: raw_block(module, opt, sched, batches, block, clip, autocast=True),
    }
    if not args.no_compile:
        compiled = torch.compile(module.net)
        raw_block(module, opt, sched, batches, 1, clip, forward=compiled)  # compile outside the timed blocks
        kernels["compiled"] = lambda: raw_block(module, opt, sched, batches, block, clip, forward=compiled)
    k = interleave(2, kernels)

    tokens_per_step = datamodule.batch_size * datamodule.context_length
    train_tps = tokens_per_step / median(t["on"])
    fpt = module.net.flops_per_token()
    results = {
        "lightning_suite_over_raw": ratio(t["on"], t["raw"]),
        "suite_on_over_off": ratio(t["on"], t["off"]),
        "lightning_suite_over_raw_cpu": ratio(t["on"], t["raw"], clock=1),
        "suite_on_over_off_cpu": ratio(t["on"], t["off"], clock=1),
        "intervals": {
            "lightning_suite_over_raw": interval(t["on"], t["raw"]),
            "suite_on_over_off": interval(t["on"], t["off"]),
            "lightning_suite_over_raw_cpu": interval(t["on"], t["raw"], clock=1),
            "suite_on_over_off_cpu": interval(t["on"], t["off"], clock=1),
        },
        "overhead_ms_per_step": 1e3 * (median(t["on"]) - median(t["raw"])),
        "suite_hook_share_of_step": suite_hook_share(run, module, datamodule, 3 * args.steps),
        "python_calls_per_step": python_calls(run, module, datamodule, raw, 5 if args.quick else 20),
        "loader_over_training_tokens_per_sec": loader_tokens_per_sec(datamodule, 20 if args.quick else 200) / train_tps,
        "mixture_read_share_of_step": mixture_read_share(datamodule, median(t["on"]), 10 if args.quick else 100),
        "bf16_over_fp32_cpu": ratio(k["bf16"], k["fp32"]),
        "compiled_over_eager": ratio(k["compiled"], k["fp32"]) if "compiled" in k else None,
        "flops_per_token": fpt,
        "train_tokens_per_sec": train_tps,
        "model_flops_per_sec": fpt * train_tps,
        "params": module.net.num_params(),
        "step_ms": 1e3 * median(t["raw"]),
        "steps_timed": sum(len(b) for b in t["raw"]),
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
    print(
        f"{'suite hook time / step time (profiler)':40} {share:7.3f}  {'':15}  <= 0.02  {'met' if share <= 0.02 else 'missed'}"
    )
    print(
        f"{'tokens/s: data loader / training':40} {loader:7.1f}  {'':15}  >= 50    {'met' if loader >= 50 else 'missed'}"
    )
    share, low, high = r["mixture_read_share_of_step"]
    print(
        f"{'data.sources read cost / step':40} {share:7.4f}  [{low:.4f}, {high:.4f}]  <= 0.02  {verdict(low, high, 0.02)}"
    )
    print(
        f"{'step time: bf16 autocast / fp32 (CPU)':40} {r['bf16_over_fp32_cpu']:7.3f}  {'':15}  < 1 where the CPU has bf16 units"
    )
    compiled = r["compiled_over_eager"]
    print(
        f"{'step time: torch.compile / eager':40} {'skipped' if compiled is None else f'{compiled:7.3f}':>7}  {'':15}  < 1"
    )
    print(f"\nmodel: {r['params']:,} params, {r['flops_per_token']:,} FLOPs/token (6N + 12·L·d·T)")
    print(
        f"raw step {r['step_ms']:.1f} ms on {r['threads']} threads; Lightning + suite adds {r['overhead_ms_per_step']:+.2f} ms"
    )
    c = r["python_calls_per_step"]
    print(
        f"Python calls per ordinary step: raw loop {c['raw']:,.0f}, Lightning with callbacks=minimal "
        f"{c['minimal']:,.0f}, with the suite {c['suite']:,.0f}; steadylm functions an ordinary step calls: "
        f"{c['steadylm_functions']} in {c['steadylm_files']} files"
    )
    extra = c["suite"] - c["raw"]
    if extra > 0 and r["overhead_ms_per_step"] > 0:
        print(
            f"  {extra:,.0f} calls more than the raw loop: {1e3 * r['overhead_ms_per_step'] / extra:.1f} µs each "
            "would make up the whole overhead"
        )
    print(
        f"training: {r['train_tokens_per_sec']:,.0f} tokens/s = {r['model_flops_per_sec'] / 1e9:.2f} GFLOP/s achieved"
    )
    print(f"{r['steps_timed']} paired steps; 'unresolved' = the noise spans the target: run more --rounds")


if __name__ == "__main__":
    main()
