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

--to-loss: time to a loss instead (issue 43): nanoGPT's own `train.py` (its small-model config) and steadylm's
`experiment=fast` started together, one thread each; the ratio of steadylm's wall time to nanoGPT's val loss after
--steps (600; exact on the shards' val split) over nanoGPT's time for those steps (target <= 0.25), and of steps.

--rss: peak RSS instead, each run a process of its own: nanoGPT's `train.py` (the checkout's, on the same
tokens written as its `train.bin`/`val.bin`, fp32 on the CPU, no compile, one micro-step a step) against
steadylm's `train.py` at the same shape and steps, with the default suite, `callbacks=minimal` and
snapshots off; `ru_maxrss` of each process (os.wait4), and each one's ratio to nanoGPT's (target <= 1.2).
With `--rounds N` (default 1) the four runs repeat N times in turn; each ratio is then the median over the
rounds of that round's peak / nanoGPT's peak (glibc's heap high-water moves peaks by ~0.04 GB run to run).

Usage: python benchmarks/nanogpt_bench.py --nanogpt PATH [--rounds N] [--steps N] [--quick] [overrides...]
       python benchmarks/nanogpt_bench.py --nanogpt PATH --rss [--steps N] [--rounds N]
       python benchmarks/nanogpt_bench.py --nanogpt PATH --to-loss [--steps 600] [--rounds N] [overrides...]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import pickle
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np
import torch
import torch.nn.functional as F
from bench import CHUNK, overhead_samples, paired_ratios, paired_run, raw_step, setup, verdict
from bench import interval as paired_interval
from bench import ratio as ratio_of_medians
from time_to_loss import Clock, reach

from steadylm.config import compose
from steadylm.data.prepare import prepare
from steadylm.data.shards import DATASET
from steadylm.devices import resolve_precision
from steadylm.model.gpt import IGNORE_INDEX
from steadylm.schedule import set_lr
from steadylm.train import build

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


def nanogpt_workdir(checkout: Path, prefix: str) -> Path:
    """A folder holding the embedded corpus as steadylm's shards (`shards/`) and, for nanoGPT's own `train.py` run
    from it, the same tokens as its `data/steadylm/{train,val}.bin` and the `configurator.py` it exec()s from cwd."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    prepare(input=None, out_dir=work / "shards", max_bytes=3_000_000, progress=False)
    nano_data = work / "data" / "steadylm"
    nano_data.mkdir(parents=True)
    for split in ("train", "val"):
        files = sorted((work / "shards").glob(f"{split}-*.h5"))
        tokens = np.concatenate([h5py.File(f, "r")[DATASET][:] for f in files]).astype(np.uint16)
        tokens.tofile(nano_data / f"{split}.bin")
    with open(nano_data / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": 320}, f)
    (work / "configurator.py").symlink_to((checkout / "configurator.py").resolve())
    return work


def rss(checkout: Path, steps: int, rounds: int = 1) -> dict[str, list[float]]:
    """nanoGPT's train.py and steadylm's on the same tokens and shape, one process each: peak RSS in GB."""
    if not (checkout / "train.py").is_file():
        raise SystemExit(f"error: --nanogpt {checkout}: no train.py there (--rss runs nanoGPT's own training script)")
    work = nanogpt_workdir(checkout, "steadylm-rss-")
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


def to_loss(checkout: Path, steps: int, rounds: int, eval_every: int, overrides: list[str]) -> list[dict]:
    """nanoGPT's own `train.py` (its small-model config, `config/train_shakespeare_char.py`, at the issue's shape,
    dropout 0, fp32, `steps` iterations with a tenth warmup and the cosine to `steps`) and steadylm's
    `experiment=fast` (`train.py`'s path, the default suite on) started together, one thread each. The target is
    nanoGPT's val loss after `steps`, exact on the shards' val split; steadylm's time to it is its training wall
    time up to its first evaluation at or below it (every `eval_every` steps, evaluations not counted); nanoGPT's is
    the sum of the step times it prints (its two 1-batch estimates included). Round r runs steadylm at seed r: the
    interval holds seeds and timing noise (nanoGPT's own seed is fixed)."""
    if not (checkout / "config" / "train_shakespeare_char.py").is_file():
        raise SystemExit(f"error: --nanogpt {checkout}: no config/train_shakespeare_char.py (a nanoGPT checkout?)")
    work, m, out = nanogpt_workdir(checkout, "steadylm-to-loss-"), dict(kv.split("=", 1) for kv in SHAPE), []
    torch.set_num_threads(1)
    for r in range(rounds):
        nano_cmd = [
            sys.executable, str((checkout / "train.py").resolve()),
            str((checkout / "config" / "train_shakespeare_char.py").resolve()), "--dataset=steadylm", "--device=cpu",
            "--dtype=float32", "--compile=False", f"--n_layer={m['model.n_layer']}", f"--n_head={m['model.n_head']}",
            f"--n_embd={m['model.d_model']}", f"--block_size={m['model.context_length']}",
            f"--batch_size={m['data.batch_size']}", "--dropout=0.0", f"--max_iters={steps}",
            f"--lr_decay_iters={steps}", f"--warmup_iters={steps // 10}", f"--eval_interval={steps}",
            "--eval_iters=1", "--log_interval=1", "--always_save_checkpoint=True", f"--out_dir={work / f'nano{r}'}",
        ]  # fmt: skip
        print(f"round {r + 1}/{rounds}: nanoGPT train.py and steadylm experiment=fast, together …", file=sys.stderr)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            nano_cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        cfg = compose(
            [
                "trainer=cpu", f"data.dir={work / 'shards'}", f"paths.output_dir={work / f'fast{r}'}", "logger=none",
                "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                "trainer.num_sanity_val_steps=0", f"trainer.max_steps={steps}",
                f"trainer.val_check_interval={eval_every}", "data.val_windows=null", "~callbacks.checkpoint",
                "experiment=fast", f"seed={r + 1}", *SHAPE, *overrides,
            ]
        )  # fmt: skip
        objects, clock = build(cfg), Clock()
        objects["trainer"].callbacks.append(clock)
        objects["trainer"].fit(objects["module"], datamodule=objects["datamodule"])
        log, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"error: nanoGPT's train.py failed:\n{log[-2000:]}")
        times = [float(t) for n, t in re.findall(r"^iter (\d+): .*time ([\d.]+)ms", log, re.M) if int(n) < steps]
        ckpt = torch.load(work / f"nano{r}" / "ckpt.pt", map_location="cpu", weights_only=False)
        net = load(checkout).GPT(load(checkout).GPTConfig(**ckpt["model_args"]))
        net.load_state_dict(ckpt["model"])
        target = exact_val_loss(net, objects["datamodule"].val_dataloader())
        hit = reach(clock.curve, target)
        row = {"target": target, "nanogpt_wall": sum(times) / 1e3, "fast_curve": clock.curve, "hit": hit}
        row["steps_x"], row["wall_x"] = (hit[0] / steps, hit[1] / row["nanogpt_wall"]) if hit else (None, None)
        out.append(row)
        reached = f"step {hit[0]}, {hit[1]:.1f} s" if hit else f"not reached (final {clock.curve[-1][3]:.4f})"
        print(
            f"round {r + 1}: nanoGPT val {target:.4f} after {steps} steps in {row['nanogpt_wall']:.1f} s; "
            f"experiment=fast: {reached}" + (f"; steps {row['steps_x']:.3f}x, wall {row['wall_x']:.3f}x" if hit else "")
        )
    walls = [row["wall_x"] for row in out if row["wall_x"] is not None]
    if walls:
        print(
            f"experiment=fast / nanoGPT, wall time to nanoGPT's {steps}-step val loss: median "
            f"{statistics.median(walls):.3f} [{min(walls):.3f}, {max(walls):.3f}] over {len(walls)} round(s); "
            f"target <= 0.25: {'met' if max(walls) <= 0.25 else 'missed'}"
        )
    return out


@torch.no_grad()
def exact_val_loss(net, loader) -> float:
    """Token-weighted cross-entropy of nanoGPT's model over every val window (padding targets left out)."""
    net.eval()
    total, count = 0.0, 0
    for x, y in loader:
        logits, _ = net(x, y.clamp(min=0))  # with targets nanoGPT returns every position's logits
        total += float(F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"))
        count += int((y != IGNORE_INDEX).sum())
    return total / count


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nanogpt", type=Path, required=True, help="a nanoGPT checkout (its model.py is imported)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes for the test suite; numbers are not meaningful")
    ap.add_argument("--rounds", type=int, help="trainer.fit runs and model-only blocks per side (4); --rss: rounds (1)")
    ap.add_argument("--steps", type=int, help="timed steps per run (40); --rss: steps of each training run (80)")
    ap.add_argument("--rss", action="store_true", help="peak RSS of each train.py in its own process instead")
    ap.add_argument("--to-loss", action="store_true", help="experiment=fast's wall time to nanoGPT's val loss instead")
    ap.add_argument("--eval-every", type=int, default=20, help="--to-loss: steps between steadylm's val losses")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides after the default shape, e.g. data.batch_size=8")
    args = ap.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if args.rss:
        return rss(args.nanogpt, args.steps or 80, args.rounds or 1)
    if args.quick:
        SHAPE[:] = [
            "model.n_layer=1",
            "model.d_model=32",
            "model.n_head=2",
            "model.context_length=32",
            "data.batch_size=16",
        ]
    if args.to_loss:
        logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
        steps = 20 if args.quick else args.steps or 600
        return to_loss(args.nanogpt, steps, args.rounds or 1, 10 if args.quick else args.eval_every, args.overrides)
    args.steps, args.rounds = args.steps or 40, args.rounds or 4
    if args.quick:
        args.rounds, args.steps = 1, CHUNK
    if args.rounds < 1 or args.steps < CHUNK:
        ap.error(f"--rounds must be >= 1 and --steps >= {CHUNK} (the bootstrap resamples runs of {CHUNK} steps)")
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    nano_module = load(args.nanogpt)
    run, module, datamodule, raw = setup(args.quick, [*SHAPE, *args.overrides])
    cfg = run.cfg
    net, opt = nanogpt(nano_module, cfg)

    def nano() -> None:
        nanogpt_step(net, opt, raw.sched, next(raw.batches), raw.clip)

    print(f"whole step: {args.rounds} runs of {args.steps} steps, each paired with a nanoGPT step …", file=sys.stderr)
    runs = [paired_run(run, module, datamodule, nano, args.steps, r) for r in range(args.rounds)]
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
    # `trainer.precision=auto`, steadylm's default, is bf16 autocast on a CPU with bf16 units; nanoGPT's train.py
    # runs fp32 on any CPU (no autocast off CUDA), so the default-to-default comparison is this row.
    auto = resolve_precision("auto", "cpu")
    if auto == "bf16-mixed" and not args.quick:
        print("whole step again at trainer.precision=auto (bf16-mixed here) …", file=sys.stderr)
        run16, module16, datamodule16, _ = setup(False, [*SHAPE, "trainer.precision=bf16-mixed", *args.overrides])
        t16 = overhead_samples(
            [paired_run(run16, module16, datamodule16, nano, args.steps, r) for r in range(args.rounds)]
        )
        rows["whole step, suite on, trainer.precision=auto (bf16-mixed: bf16 units)"] = (t16["on"], t16["raw"])
    else:
        print(
            f"(trainer.precision=auto is {auto} on this CPU{'' if args.quick else ': no bf16 units'}: the rows below are the default's)"
        )
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
