"""steadylm's training step against nanoGPT's, side by side in one process (issue 24, item 4).

nanoGPT is neither a dependency nor copied here: `--nanogpt` names a checkout
(`git clone https://github.com/karpathy/nanoGPT`) and its `model.py` is imported from there. Two ratios, each
from samples taken side by side (bench.py's pairing and bootstrap, its verdict against 1.00: "at least
nanoGPT's tokens/s"):

  steadylm / nanoGPT, whole step   inside one `trainer.fit` of `train.py`'s path, after every Lightning step
                                   (default suite on) one nanoGPT step runs on the same batch and is timed on
                                   its own: its GPT at the same shape, its `configure_optimizers` (fused AdamW
                                   on CUDA only, as it writes it), forward with targets, backward,
                                   `clip_grad_norm_`, the same warmup/cosine LR, step, zero_grad
  steadylm / nanoGPT, model only   the same plain loop around each model (steadylm's `GPT` with its loss and
                                   AdamW recipe against nanoGPT's), a pair of steps at a time in random order:
                                   what the model and optimizer cost apart from Lightning and the suite

Default shape: the issue's 4 layers, d 256, 4 heads, context 256, batch 16, fp32, on the embedded corpus
(byte vocabulary, 320).

--rss: peak RSS instead, each run a process of its own: nanoGPT's `train.py` (the checkout's, on the same
tokens written as its `train.bin`/`val.bin`, fp32 on the CPU, no compile, one micro-step a step) against
steadylm's `train.py` at the same shape and steps, with the default suite, `callbacks=minimal` and
snapshots off; `ru_maxrss` of each process (os.wait4), and each one's ratio to nanoGPT's (target <= 1.2).
With `--rounds N` (default 1) the four runs repeat N times in turn; each ratio is then the median over the
rounds of that round's peak / nanoGPT's peak (glibc's heap high-water moves peaks by ~0.04 GB run to run).

Usage: python benchmarks/nanogpt_bench.py --nanogpt PATH [--rounds N] [--steps N] [--quick] [overrides...]
       python benchmarks/nanogpt_bench.py --nanogpt PATH --rss [--steps N] [--rounds N]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import torch
from bench import CHUNK, overhead_samples, paired_ratios, paired_run, raw_step, setup, verdict
from bench import interval as paired_interval
from bench import ratio as ratio_of_medians

from steadylm.data.prepare import prepare
from steadylm.data.shards import DATASET
from steadylm.schedule import set_lr

SHAPE = ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.context_length=256", "data.batch_size=16"]


def load(path: Path):
    """nanoGPT's model.py from a checkout, under a name of its own (its `model` would shadow nothing here)."""
    file = path / "model.py"
    if not file.is_file():
        raise SystemExit(f"error: --nanogpt {path}: no model.py there (git clone https://github.com/karpathy/nanoGPT)")
    spec = importlib.util.spec_from_file_location("nanogpt_model", file)
    nano = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(nano)
    return nano


def nanogpt(nano, cfg):
    """nanoGPT's GPT at cfg's shape and its own AdamW groups."""
    m, o = cfg.model, cfg.optim
    net = nano.GPT(
        nano.GPTConfig(
            block_size=m.context_length,
            vocab_size=m.vocab_size,
            n_layer=m.n_layer,
            n_head=m.n_head,
            n_embd=m.d_model,
            dropout=0.0,
            bias=m.bias,
        )
    )
    opt = net.configure_optimizers(o.weight_decay, o.lr, tuple(o.betas), "cpu")
    return net, opt


def nanogpt_step(net, opt, lr, batch, clip: float | None) -> None:
    """nanoGPT's train.py step (one micro-step, no GradScaler: fp32)."""
    x, y = batch
    _, loss = net(x, y)
    loss.backward()
    if clip:
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
    set_lr(opt, lr())
    opt.step()
    opt.zero_grad(set_to_none=True)


def peak_rss_gb(cmd: list[str], cwd: Path) -> float:
    """Peak resident memory of one process (and the children it waited for), in GB."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"error: {' '.join(cmd[:3])} ... failed:\n{proc.stderr.read()[-2000:]}")
    return usage.ru_maxrss / 1e6  # kilobytes on Linux


def rss(checkout: Path, steps: int, rounds: int = 1) -> dict[str, list[float]]:
    """nanoGPT's train.py and steadylm's on the same tokens and shape, one process each: peak RSS in GB."""
    if not (checkout / "train.py").is_file():
        raise SystemExit(f"error: --nanogpt {checkout}: no train.py there (--rss runs nanoGPT's own training script)")
    work = Path(tempfile.mkdtemp(prefix="steadylm-rss-"))
    prepare(input=None, out_dir=work / "shards", max_bytes=3_000_000, progress=False)
    nano_data = work / "data" / "steadylm"  # nanoGPT reads data/<dataset>/ under its working directory
    nano_data.mkdir(parents=True)
    for split in ("train", "val"):
        files = sorted((work / "shards").glob(f"{split}-*.h5"))
        tokens = np.concatenate([h5py.File(f, "r")[DATASET][:] for f in files]).astype(np.uint16)
        tokens.tofile(nano_data / f"{split}.bin")
    with open(nano_data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 320}, f)
    (work / "configurator.py").symlink_to((checkout / "configurator.py").resolve())  # train.py exec()s it from cwd
    m = dict(kv.split("=", 1) for kv in SHAPE)
    warmup = max(1, steps // 10)
    nano = [
        sys.executable, str((checkout / "train.py").resolve()), "--dataset=steadylm", "--device=cpu", "--dtype=float32",
        "--compile=False", f"--n_layer={m['model.n_layer']}", f"--n_head={m['model.n_head']}",
        f"--n_embd={m['model.d_model']}", f"--block_size={m['model.context_length']}",
        f"--batch_size={m['data.batch_size']}", "--gradient_accumulation_steps=1", "--bias=True", "--dropout=0.0",
        f"--max_iters={steps}", f"--lr_decay_iters={steps}", f"--warmup_iters={warmup}", "--eval_interval=100000",
        "--eval_iters=8", "--log_interval=100000", "--always_save_checkpoint=False", f"--out_dir={work / 'out'}",
    ]  # fmt: skip
    ours = [
        sys.executable, str(Path(__file__).resolve().parents[1] / "train.py"), *SHAPE, f"data.dir={work / 'shards'}",
        f"trainer.max_steps={steps}", f"optim.warmup_steps={warmup}", "trainer.precision=32-true",
        "trainer.limit_val_batches=0", "trainer.val_check_interval=100000", "trainer.enable_progress_bar=false",
    ]  # fmt: skip
    runs = {
        "nanoGPT train.py": nano,
        "steadylm, default suite": ours,
        "steadylm, callbacks=minimal": [*ours, "callbacks=minimal"],
        "steadylm, snapshots off": [*ours, "callbacks.stability.recovery.every_n_steps=0"],
    }
    peaks: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for i, (name, cmd) in enumerate(runs.items()):
            print(f"round {r + 1}/{rounds}: {name} …", file=sys.stderr)
            extra = [] if name.startswith("nanoGPT") else [f"paths.output_dir={work / f'run{r}-{i}'}"]
            peaks[name].append(peak_rss_gb(cmd + extra, cwd=work))
    base = peaks["nanoGPT train.py"]
    print(f"\npeak RSS, {steps} steps ({', '.join(SHAPE)}, fp32, CPU), each run its own process, {rounds} round(s)")
    for name, gbs in peaks.items():
        shown = " ".join(f"{gb:4.2f}" for gb in gbs)
        if name.startswith("nanoGPT"):
            print(f"  {name:30} {shown} GB")
            continue
        ratio = statistics.median(gb / b for gb, b in zip(gbs, base))
        print(f"  {name:30} {shown} GB  {ratio:5.2f}x  {'met' if ratio <= 1.2 else 'missed'} (<= 1.2x)")
    return peaks


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout (its model.py is imported)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes for the test suite; numbers are not meaningful")
    ap.add_argument("--rounds", type=int, help="trainer.fit runs and model-only blocks per side (4); --rss: rounds (1)")
    ap.add_argument("--steps", type=int, help="timed steps per run (40); --rss: steps of each training run (80)")
    ap.add_argument("--rss", action="store_true", help="peak RSS of each train.py in its own process instead")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides after the default shape, e.g. data.batch_size=8")
    args = ap.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.rss:
        return rss(args.nanogpt, args.steps or 80, args.rounds or 1)
    args.steps, args.rounds = args.steps or 40, args.rounds or 4
    if args.quick:
        args.rounds, args.steps = 1, CHUNK
        SHAPE[:] = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context_length=32"]
    if args.rounds < 1 or args.steps < CHUNK:
        ap.error(f"--rounds must be >= 1 and --steps >= {CHUNK} (the bootstrap resamples runs of {CHUNK} steps)")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    nano_module = load(args.nanogpt)
    cfg, module, datamodule, raw = setup(args.quick, [*SHAPE, *args.overrides])
    net, opt = nanogpt(nano_module, cfg)

    def nano() -> None:
        nanogpt_step(net, opt, raw.sched, next(raw.batches), raw.clip)

    print(f"whole step: {args.rounds} runs of {args.steps} steps, each paired with a nanoGPT step …", file=sys.stderr)
    runs = [paired_run(cfg, module, datamodule, nano, args.steps, r) for r in range(args.rounds)]
    t = overhead_samples(runs)
    print("model only: plain steps, a pair at a time in random order …", file=sys.stderr)
    pairs = paired_ratios(lambda: raw_step(module, raw.opt, raw.sched, next(raw.batches), raw.clip), nano, args.steps)
    tokens = datamodule.batch_size * datamodule.context_length
    rows = {
        "whole step, suite on (Lightning + default callbacks)": (t["on"], t["raw"]),
        "whole step, suite off (callbacks=minimal's steps)": (t["off"], t["raw"]),
    }
    shape = f"L{cfg.model.n_layer} d{cfg.model.d_model} T{cfg.model.context_length} B{cfg.data.batch_size}, fp32"
    print(f"\nsteadylm / nanoGPT step time ({shape}, {torch.get_num_threads()} threads; < 1: steadylm is faster)")
    print(f"{'':54} {'ratio':>6}  {'90% interval':>15}  target  verdict")
    results = {}
    for name, (a, b) in rows.items():
        value, (low, high) = ratio_of_medians(a, b), paired_interval(a, b)
        results[name] = {"ratio": value, "interval": [low, high]}
        print(f"{name:54} {value:6.3f}  [{low:.3f}, {high:.3f}]  <= 1.0  {verdict(low, high, 1.0)}")
    value, low, high, _, _ = pairs
    results["model + optimizer only (plain loops)"] = {"ratio": value, "interval": [low, high]}
    print(
        f"{'model + optimizer only (plain loops, paired steps)':54} {value:6.3f}  [{low:.3f}, {high:.3f}]  <= 1.0  {verdict(low, high, 1.0)}"
    )
    for name, a in (("steadylm (suite on)", t["on"]), ("nanoGPT", t["raw"])):
        ms = 1e3 * sorted(x[0] for block in a for x in block)[sum(map(len, a)) // 2]
        print(f"  {name:20} {ms:8.1f} ms/step  {tokens / ms * 1e3:9,.0f} tokens/s")
    return results


if __name__ == "__main__":
    main()
