"""GPU throughput and MFU of `model=small` (GPT-2 124M) in bf16 with torch.compile, on one GPU.

Not part of the test suite (no GPU there). Prints tokens/s, MFU against the peak table in
`steadylm.progress`, which SDPA kernel the attention can use, and how many synchronizing CUDA calls
each step makes (`torch.cuda.set_sync_debug_mode`): expected 0 on ordinary steps (the stability measurement reads
each step's value one step late), a few on logging steps. Goal on one H200: MFU >= 45%.
`--compare-defer` runs again with `callbacks.stability.defer=false` and prints the cost of reading at the step itself.

Usage: python benchmarks/gpu.py [--steps 60] [--batch 16] [--no-compile] [--compare-defer] [overrides...]
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

from steadylm.config import compose
from steadylm.data.prepare import prepare
from steadylm.progress import peak_flops
from steadylm.train import build

SETTLE = 10  # compile and autotune happen in the first steps


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument(
        "--compare-defer", action="store_true", help="also run with the measurement read at the step itself"
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: no CUDA GPU visible; this benchmark needs one (the CPU ratios are in `make bench`)")

    work = Path(tempfile.mkdtemp(prefix="steadylm-gpu-"))
    prepare(input=None, out_dir=work / "data", max_bytes=4_000_000, progress=False)
    overrides = [
        "model=small",
        "trainer=gpu",
        "trainer.precision=bf16-mixed",
        f"compile={not args.no_compile}",
        f"data.dir={work / 'data'}",
        f"data.batch_size={args.batch}",
        "data.num_workers=2",
        "data.pin_memory=true",
        f"paths.output_dir={work / 'run'}",
        f"trainer.max_steps={args.steps}",
        "optim.warmup_steps=10",
        "trainer.limit_val_batches=0",
        "trainer.val_check_interval=1000000",
        "logger=none",
        "~callbacks.checkpoint",
        "trainer.enable_progress_bar=false",
        *args.overrides,
    ]
    cfg = compose(overrides)
    objects, times, all_syncs = fit_and_time(cfg)

    tokens = cfg.data.batch_size * cfg.model.context_length
    tps = tokens / statistics.median(times)
    net = objects["module"].net
    name = torch.cuda.get_device_name()
    peak = peak_flops(name)
    print(f"device: {name}; params {net.num_params():,}; FLOPs/token {net.flops_per_token():,}")
    print(
        f"flash attention usable: {flash_attention_usable(net.cfg.d_model // net.cfg.n_head, net.cfg.context_length)}"
    )
    print(f"step time (median of {len(times)}): {statistics.median(times) * 1e3:.1f} ms; tokens/s: {tps:,.0f}")
    achieved = tps * net.flops_per_token()
    mfu = f"{achieved / peak:.1%}" if peak else "unknown (device not in steadylm.progress.PEAK_FLOPS)"
    print(f"model FLOP/s: {achieved / 1e12:.1f} TFLOP/s; MFU: {mfu}")
    every = cfg.trainer.log_every_n_steps
    logging = [n for i, n in enumerate(all_syncs) if i >= SETTLE and (i + 1) % every == 0]
    ordinary = [n for i, n in enumerate(all_syncs) if i >= SETTLE and (i + 1) % every]
    print(
        f"synchronizing CUDA calls per ordinary step: median {statistics.median(ordinary)}, max {max(ordinary)}; "
        f"per logging step (every {every}th): median {statistics.median(logging) if logging else 'n/a'}"
    )
    if args.compare_defer:
        _, same_step, _ = fit_and_time(compose([*overrides, "callbacks.stability.defer=false"]))
        print(
            f"step time: measurement read at the step itself / deferred = {statistics.median(same_step) / statistics.median(times):.3f}"
        )


if __name__ == "__main__":
    main()
