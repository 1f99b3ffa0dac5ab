"""Is every model preset's default LR a good one? Per preset and optimizer: the default, the best measured, the ratio.

`python benchmarks/lr_defaults.py [--presets tiny,llama_tiny,small,...] [--optims adamw,muon] [--sweep tiny,llama_tiny]
[--steps 100] [--batch 16] [--context 64] [--seeds 0,1]`

A preset in `--sweep` (those a CPU trains in seconds) is trained at its own shape and defaults (the optimizer
group's every key, the preset's parametrisation) with `optim.lr` on a grid of octaves around its default,
walked as `lr_transfer.py` walks it, on the embedded corpus, `--steps` steps with warmup + cosine, each point
the mean held-out loss over `--seeds`; the best LR is the parabola's vertex through the best octave and its
neighbours. Every other preset gets doctor's verdict at its defaults: its LR probe (`doctor/lr_probe.py`, the
proxy and steps doctor itself uses) and the largest stable LR it found. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from lr_transfer import batch, best_log2_lr, held_out_loss, walk, windows
from omegaconf import OmegaConf

from steadylm.config import compose
from steadylm.doctor.lr_probe import probe_lrs
from steadylm.resolve import fill_derived

PRESETS = "tiny,llama_tiny,small,medium,large,llama_small,llama_1b"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default=PRESETS)
    ap.add_argument("--optims", default="adamw,muon")
    ap.add_argument("--sweep", default="tiny,llama_tiny", help="presets trained on an LR grid; the rest: the probe")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=64)
    ap.add_argument("--val-windows", type=int, default=128)
    ap.add_argument("--seeds", default="0,1")
    return ap.parse_args()


def measured_best(args, preset: str, optim_name: str, data) -> tuple[float, float, str]:
    """(default LR, best LR, how) from a walk over optim.lr in octaves of the default, at the preset's shape."""
    cfg = compose([f"model={preset}", f"optim={optim_name}"])
    fill_derived(cfg)  # the null vocabulary from the default shards (the embedded corpus's bytes, as `windows`)
    model = {**OmegaConf.to_container(cfg.model, resolve=True), "context_length": args.context}
    optim = OmegaConf.to_container(cfg.optim, resolve=True)
    default = float(optim["lr"])
    train, val_batches = data
    seeds = [int(s) for s in args.seeds.split(",")]

    def evaluate(k: int) -> float:
        lr = default * 2.0**k
        o = {**optim, "lr": lr, "min_lr": 0.1 * lr, "warmup_steps": max(1, args.steps // 10), "total_steps": args.steps}
        o["fused"] = False
        return sum(held_out_loss(model, o, args.steps, args.batch, train, val_batches, s) for s in seeds) / len(seeds)

    runs = walk(evaluate, 0, -6, 6)
    best, loss = best_log2_lr(runs)
    grid = " ".join(f"{default * 2.0**k:.2g}:{v:.3f}" for k, v in runs.items())
    return default, default * 2.0**best, f"sweep, {args.steps} steps, seeds {args.seeds}, loss {loss:.3f} ({grid})"


def probe_verdict(preset: str, optim_name: str) -> tuple[float, float | None, str]:
    """(default LR, the largest stable LR doctor's probe found, its verdict and what it probed)."""
    cfg = compose([f"model={preset}", f"optim={optim_name}", "trainer=cpu"], config_name="doctor")
    fill_derived(cfg)  # as doctor does: the null vocabulary from the shards, the warmup from the run length
    cpu, wall = time.process_time(), time.perf_counter()
    sweep = probe_lrs(cfg)
    verdict = {None: "OK", 3.0: "WARN", 1.0: "FAIL"}.get(sweep.first_bad, "OK")
    cost = f"{time.perf_counter() - wall:.0f} s, {time.process_time() - cpu:.0f} s of CPU"
    return sweep.lr, sweep.best, f"doctor probe {verdict}: {sweep.what} ({cost})"


def main() -> None:
    args = parse_args()
    threads = torch.get_num_threads()  # the probe runs as doctor runs it; the sweeps one thread each
    sweep = set(args.sweep.split(","))
    data = None
    if sweep & set(args.presets.split(",")):
        train, val = windows(args.context)
        idx = list(range(min(len(val), args.val_windows)))
        data = (train, [batch(val, idx[i : i + args.batch]) for i in range(0, len(idx), args.batch)])
    rows, t0 = [], time.time()
    for preset in args.presets.split(","):
        for optim_name in args.optims.split(","):
            torch.set_num_threads(1 if preset in sweep else threads)
            if preset in sweep:
                default, best, how = measured_best(args, preset, optim_name, data)
                label = "best measured"
            else:
                default, best, how = probe_verdict(preset, optim_name)
                label = "largest stable (probe)"
            ratio = f"{default / best:.2f} ({math.log2(default / best):+.1f} oct)" if best else "-"
            rows.append(f"| {preset} | {optim_name} | {default:.3g} | {best:.3g} ({label}) | {ratio} | {how} |")
            print(rows[-1], f"({time.time() - t0:.0f}s)", flush=True)
    print("\n| preset | optim | default optim.lr | best | default / best | how |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print(f"\n{time.time() - t0:.0f}s in all; sweeps 1 thread, probes {threads} threads")


if __name__ == "__main__":
    main()
