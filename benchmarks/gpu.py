"""GPU throughput and MFU of `model=small` (GPT-2 124M) in bf16 with torch.compile, on one GPU.

Not part of the test suite (no GPU there). Prints tokens/s, MFU against the peak table in
`steadylm.progress`, which SDPA kernel the attention can use, and how many synchronizing CUDA calls
each step makes (`torch.cuda.set_sync_debug_mode`): expected 0 on ordinary steps (the stability measurement reads
each step's value one step late), a few on logging steps. Goal on one H200: MFU >= 45%.
`--compare-defer` runs again with `callbacks.stability.defer=false` and prints the cost of reading at the step itself.
`--side-by-side` measures steadylm's step against a plain PyTorch loop on the same model, data, precision and compile:
inside one `trainer.fit` of `train.py`'s path per micro-batch (`--batches`) and loss path (`--losses`), a plain step
(forward, full logits and cross-entropy, backward, clip, AdamW) runs after every Lightning step on the next batch, and
the stability suite runs on a seeded random half of the Lightning steps (the other half is `callbacks=minimal`'s). Each
stamp waits for the GPU, so a pair's two steps are timed alike. It prints tokens/s, MFU and peak memory of the plain
loop, `callbacks=minimal` and the suite, the ratios to the plain loop with 90 % intervals (bench.py's bootstrap over
runs of 10 steps), and chunked / plain (each fit's suite/plain ratio, so the plain loop cancels the fits' drift).
`--to-loss` trains `model=small`'s default recipe and `experiment=fast` for --steps each and prints both throughputs
and the steps and time each takes to the default's final val loss. `--cpu` runs the same code on the CPU at a tiny
shape (the tests' form; its numbers mean nothing).

Usage: python benchmarks/gpu.py [--steps 60] [--batch 16] [--no-compile] [--compare-defer] [--to-loss [--every 25]]
       [--side-by-side [--batches 16,32,64] [--losses chunked,plain]] [--cpu] [overrides...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import lightning as L
import torch
from bench import CHUNK, RawLoop, interval, overhead_samples, paired_run
from bench import median as median_of
from bench import ratio as ratio_of_medians
from time_to_loss import Clock, reach

from steadylm.config import compose
from steadylm.data.prepare import prepare
from steadylm.progress import peak_flops
from steadylm.train import build

SETTLE = 10  # compile and autotune happen in the first steps
# --cpu: the same code at a shape a CPU runs in seconds (the test's smoke run); its numbers mean nothing.
CPU = ["trainer=cpu", "trainer.precision=32-true", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
       "model.context_length=32", "model.vocab_size=320"]  # fmt: skip


class StepTimer(L.Callback):
    """Wall time between batch starts, and the synchronizing CUDA calls made inside each step."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.syncs: list[int] = []
        self._caught: list | None = None
        self._ctx = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._close()
        self.starts.append(time.perf_counter())
        self._ctx = warnings.catch_warnings(record=True)
        self._caught = self._ctx.__enter__()
        warnings.simplefilter("always")
        if pl_module.device.type == "cuda":  # a CPU run (the test's smoke run) counts none
            torch.cuda.set_sync_debug_mode("warn")

    def on_train_end(self, trainer, pl_module):
        self._close()

    def _close(self) -> None:
        if self._ctx is None:
            return
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        self.syncs.append(sum("synchroniz" in str(w.message) for w in self._caught))
        self._ctx.__exit__(None, None, None)
        self._ctx = None


def flash_attention_usable(head_dim: int, seq: int) -> bool:
    """Whether the flash kernel accepts our attention shapes in bf16 (else SDPA falls back silently)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 12, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
        return True
    except RuntimeError:
        return False


def fit_and_time(cfg) -> tuple[dict, list[float], list[int]]:
    """One `trainer.fit`; step times and sync counts with the compile/autotune steps dropped."""
    objects = build(cfg)
    timer = StepTimer()
    objects["trainer"].callbacks.append(timer)
    objects["trainer"].fit(objects["module"], datamodule=objects["datamodule"])
    starts = timer.starts
    return objects, [b - a for a, b in zip(starts, starts[1:])][SETTLE:], timer.syncs


def throughput(name: str, objects, times: list[float], syncs: list[int] | None) -> float:
    """Print tokens/s, MFU and (on CUDA) the sync counts of one fit; return its median step time."""
    cfg, net, step = objects["cfg"], objects["module"].net, statistics.median(times)
    tps = cfg.data.batch_size * cfg.model.context_length / step
    cuda = torch.cuda.is_available() and cfg.trainer.accelerator != "cpu"
    device = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_flops(device) if cuda else None
    achieved = tps * net.flops_per_token()
    mfu = f"{achieved / peak:.1%}" if peak else "unknown (device not in steadylm.progress.PEAK_FLOPS)"
    print(f"{name}: device {device}; params {net.num_params():,}; FLOPs/token {net.flops_per_token():,}")
    print(f"  step time (median of {len(times)}): {step * 1e3:.1f} ms; tokens/s: {tps:,.0f}")
    print(f"  model FLOP/s: {achieved / 1e12:.2f} TFLOP/s; MFU: {mfu}")
    if cuda and syncs is not None:
        every = cfg.trainer.log_every_n_steps
        logging = [n for i, n in enumerate(syncs) if i >= SETTLE and (i + 1) % every == 0]
        ordinary = [n for i, n in enumerate(syncs) if i >= SETTLE and (i + 1) % every]
        print(
            f"  synchronizing CUDA calls per ordinary step: median {statistics.median(ordinary)}, max "
            f"{max(ordinary)}; per logging step (every {every}th): "
            f"median {statistics.median(logging) if logging else 'n/a'}"
        )
    return step


def to_loss(overrides: list[str], steps: int, every: int) -> None:
    """`model=small`'s default recipe and `experiment=fast` at the same shape, each `steps` steps with a val loss
    every `every`: the steps and time (steps x the median step time, validation left out) each takes to the
    default recipe's final val loss."""
    runs = {}
    for name, extra in (("default", []), ("experiment=fast", ["experiment=fast"])):
        cfg = compose([*overrides, *extra, f"trainer.max_steps={steps}", f"trainer.val_check_interval={every}"])
        cfg.optim.warmup_steps = max(1, steps // 10)  # both recipes warm up alike over this short run
        clock = Clock()
        objects = build(cfg)
        timer = StepTimer()
        objects["trainer"].callbacks.extend([timer, clock])
        objects["trainer"].fit(objects["module"], datamodule=objects["datamodule"])
        times = [b - a for a, b in zip(timer.starts, timer.starts[1:])][SETTLE:]
        val_steps = {p[0] for p in clock.curve}
        times = [t for i, t in enumerate(times, SETTLE + 1) if i not in val_steps] or times
        runs[name] = (clock.curve, throughput(name, objects, times, None))
    target = runs["default"][0][-1][3]
    print(f"time to the default recipe's val loss after {steps} steps ({target:.4f}):")
    base = reach(runs["default"][0], target)
    for name, (curve, step) in runs.items():
        hit = reach(curve, target)
        if hit is None:
            print(f"  {name}: not reached (final {curve[-1][3]:.4f})")
            continue
        print(
            f"  {name}: step {hit[0]} ({hit[0] / base[0]:.3f}x the steps), {hit[0] * step:.1f} s "
            f"({hit[0] * step / (base[0] * runs['default'][1]):.3f}x the time)"
        )


def side_by_side(overrides: list[str], batches: list[int], losses: list[str], steps: int) -> dict:
    """Per micro-batch and loss path, one paired fit (see the module docstring); prints a table, returns its rows."""
    rows, per_step = {}, {}
    for batch in batches:
        for loss in losses:
            # Two AdamWs (Lightning's and the plain loop's) update the same weights: a low LR keeps every timed step
            # on the healthy path. Timing does not depend on the LR.
            keys = ["optim.lr=1e-4", "optim.warmup_steps=1", "trainer.max_steps=100000"]
            cfg = compose([*overrides, f"data.batch_size={batch}", f"optim.loss={loss}", *keys])
            objects = build(cfg)
            module, datamodule = objects["module"], objects["datamodule"]
            autocast = cfg.trainer.precision.startswith("bf16")
            raw = RawLoop(cfg, module, datamodule, autocast=autocast)
            if torch.cuda.is_available() and cfg.trainer.accelerator != "cpu":
                torch.cuda.reset_peak_memory_stats()
            paired = paired_run(objects["run"], module, datamodule, raw, steps, seed=batch)
            t = overhead_samples([paired])
            cuda = module.device.type == "cuda"
            peak = peak_flops(torch.cuda.get_device_name()) if cuda else None
            tokens = batch * cfg.model.context_length
            fpt = module.net.flops_per_token()
            row = {"memory_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
            for side in ("raw", "off", "on"):
                tps = tokens / median_of(t[side])
                row[side] = {"tokens_per_sec": tps, "mfu": tps * fpt / peak if peak else None}
            for side in ("off", "on"):
                row[f"{side}_over_raw"] = (ratio_of_medians(t[side], t["raw"]), *interval(t[side], t["raw"]))
            rows[(batch, loss)] = row
            lightning, plain, on = paired.samples()
            per_step[(batch, loss)] = [a[0] / b[0] for a, b, o in zip(lightning, plain, on) if o]
            del objects, module, datamodule, raw, paired
            if cuda:
                torch.cuda.empty_cache()
    report_side_by_side(rows, per_step, batches, losses)
    return rows


def chunked_over_plain(chunked: list[float], plain: list[float], resamples: int = 1000) -> tuple[float, float, float]:
    """Median suite/plain-loop ratio of the chunked fit over the plain-loss fit's, with a 90 % bootstrap interval
    (runs of CHUNK steps resampled on each side)."""
    import random

    rng = random.Random(0)

    def runs(x):
        return [x[i : i + CHUNK] for i in range(0, len(x), CHUNK)]

    def med(blocks):
        return statistics.median(v for b in blocks for v in b)

    a, b = runs(chunked), runs(plain)
    boot = sorted(med(rng.choices(a, k=len(a))) / med(rng.choices(b, k=len(b))) for _ in range(resamples))
    return med(a) / med(b), boot[int(0.05 * resamples)], boot[int(0.95 * resamples) - 1]


def report_side_by_side(rows: dict, per_step: dict, batches: list[int], losses: list[str]) -> None:
    def pct(x):
        return "n/a" if x is None else f"{x:.1%}"

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"\nside by side on {device}: tokens/s (MFU) of the plain loop, callbacks=minimal and the suite")
    print(f"{'batch':>5} {'loss':8} {'plain loop':>20} {'minimal':>20} {'suite':>20}  "
          f"{'minimal/plain [90%]':>22} {'suite/plain [90%]':>22} {'peak GB':>7}")  # fmt: skip
    for (batch, loss), r in rows.items():
        cells = [f"{r[s]['tokens_per_sec']:>10,.0f} ({pct(r[s]['mfu']):>6})" for s in ("raw", "off", "on")]
        ratios = [f"{v:.3f} [{lo:.3f}, {hi:.3f}]" for v, lo, hi in (r["off_over_raw"], r["on_over_raw"])]
        mem = "n/a" if r["memory_gb"] is None else f"{r['memory_gb']:.1f}"
        print(
            f"{batch:>5} {loss:8} {cells[0]:>20} {cells[1]:>20} {cells[2]:>20}  {ratios[0]:>22} {ratios[1]:>22} {mem:>7}"
        )
    if {"chunked", "plain"} <= set(losses):
        print("step time, suite on: chunked head and loss / plain (each over its own fit's plain loop)")
        for batch in batches:
            v, lo, hi = chunked_over_plain(per_step[(batch, "chunked")], per_step[(batch, "plain")])
            print(f"  batch {batch}: {v:.3f} [{lo:.3f}, {hi:.3f}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument(
        "--compare-defer", action="store_true", help="also run with the measurement read at the step itself"
    )
    ap.add_argument("--to-loss", action="store_true", help="the default recipe against experiment=fast, to a loss")
    ap.add_argument("--every", type=int, default=25, help="--to-loss: steps between val losses")
    ap.add_argument("--side-by-side", action="store_true", help="steadylm's step against a plain loop, paired")
    ap.add_argument("--batches", default="16,32,64", help="--side-by-side: micro-batches")
    ap.add_argument("--losses", default="chunked,plain", help="--side-by-side: loss paths (optim.loss)")
    ap.add_argument("--cpu", action="store_true", help="the CPU form (a small shape, fp32, eager): for the tests")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.side_by_side and args.steps < CHUNK:
        ap.error(f"--side-by-side needs --steps >= {CHUNK} (the bootstrap resamples runs of {CHUNK} steps)")
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU visible; this benchmark needs one (--cpu: its CPU form; `make bench`: CPU ratios)")

    work = Path(tempfile.mkdtemp(prefix="steadylm-gpu-"))
    prepare(input=None, out_dir=work / "data", max_bytes=400_000 if args.cpu else 4_000_000, progress=False)
    device = (
        CPU
        if args.cpu
        else ["trainer=gpu", "trainer.precision=bf16-mixed", "data.num_workers=2", "data.pin_memory=true"]
    )
    overrides = [
        "model=small",
        *device,
        f"compile={not (args.no_compile or args.cpu)}",
        f"data.dir={work / 'data'}",
        f"data.batch_size={args.batch}",
        f"paths.output_dir={work / 'run'}",
        f"trainer.max_steps={args.steps}",
        "optim.warmup_steps=10",
        "trainer.limit_val_batches=0" if not args.to_loss else "data.val_windows=320",
        "trainer.val_check_interval=1000000",
        "logger=none",
        "~callbacks.checkpoint",
        "trainer.enable_progress_bar=false",
        *args.overrides,
    ]
    if args.to_loss:
        return to_loss(overrides, args.steps, args.every)
    if args.side_by_side:
        batches = [int(b) for b in args.batches.split(",")]
        return side_by_side(overrides, batches, args.losses.split(","), args.steps)
    cfg = compose(overrides)
    objects, times, all_syncs = fit_and_time(cfg)
    net = objects["module"].net
    if not args.cpu:
        head, seq = net.cfg.d_model // net.cfg.n_head, net.cfg.context_length
        print(f"flash attention usable: {flash_attention_usable(head, seq)}")
    step = throughput(" ".join(args.overrides) or "model=small", objects, times, all_syncs)
    if args.compare_defer:
        _, same_step, _ = fit_and_time(compose([*overrides, "callbacks.stability.defer=false"]))
        print(f"step time: measurement read at the step itself / deferred = {statistics.median(same_step) / step:.3f}")


if __name__ == "__main__":
    main()
