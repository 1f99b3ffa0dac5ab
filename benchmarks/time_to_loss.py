"""Time to a target val loss, side by side in one process: AdamW and Muon through steadylm, and a plain loop.

  steadylm adamw   `train.py`'s path (`build` + `trainer.fit`, the stability suite on), optim=adamw
  steadylm muon    the same, optim=muon (Muon on the blocks' matrices, AdamW on the rest)
  plain loop       the loop a nanoGPT user writes on the same model and data: forward, loss, backward,
                   clip, fused AdamW, LR schedule; at AdamW's best LR

Same model (seeded init), same data order, same warmup/cosine schedule and clipping; the val loss is
measured on the same val batches every --eval-every steps, and evaluation time is not counted. Each
steadylm optimizer runs at every LR of its small sweep; its best LR is the one with the lowest final val
loss. The target is steadylm-AdamW's final val loss at its best LR: each run prints the steps, training
wall and CPU time it took to first reach it, and the ratios to steadylm-AdamW's. Runs go one after the
other, so a busy neighbour moves the wall times; process CPU time leaves out the waits for a core.

The wall ratios of runs made one after the other move with a busy neighbour (four runs of the same code: 0.62x
to 0.77x), so the last line multiplies the exact ratio of steps by a ratio of step costs measured in short
fits of each, interleaved (8 rounds of 40 steps, `train.py`'s path with the suite on).

--step-cost (in `make bench`): Muon's and AdamW's optimizer step as a fraction of a whole training step, and a
Muon step over an AdamW step, each step of one timed right after a step of the other, on the same model.

Usage: python benchmarks/time_to_loss.py [--steps N] [--adamw-lrs 1e-3,3e-3] [--muon-lrs ...] [--threads N]
       [--step-cost] [--quick] [--json FILE] [overrides...]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch

from steadylm.config import compose
from steadylm.data.prepare import prepare
from steadylm.model.gpt import IGNORE_INDEX
from steadylm.schedule import set_lr
from steadylm.train import build

QUICK = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context_length=32", "data.batch_size=4"]
Point = tuple[int, float, float, float]  # (step, training wall seconds, training CPU seconds, val loss)
TOLERANCE = 1e-4  # nats: the plain loop's val sum is added in another order than Lightning's


def now() -> tuple[float, float]:
    """(wall, process CPU) seconds: on a shared machine CPU time leaves out the waits for a core."""
    return time.perf_counter(), time.process_time()


SIZE = ["model.n_layer=4", "model.n_head=4", "model.d_model=128", "model.context_length=64", "data.batch_size=16"]


class Clock(L.Callback):
    """Training wall and CPU time at each validation (validation itself not counted) and the val loss it measured."""

    def __init__(self) -> None:
        self.curve: list[Point] = []
        self.steps: list[float] = []  # each step's wall time (batch start to batch end, the suite included)
        self.wall = self.cpu = 0.0
        self._start = (0.0, 0.0)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._start = now()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        wall, cpu = now()
        self.steps.append(wall - self._start[0])
        self.wall, self.cpu = self.wall + wall - self._start[0], self.cpu + cpu - self._start[1]

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            loss = float(trainer.callback_metrics["val/loss"])
            self.curve.append((trainer.global_step, self.wall, self.cpu, loss))


def config(work: Path, steps: int, eval_every: int, val_batches: int, overrides: list[str]):
    return compose(
        [
            "trainer=cpu",
            "trainer.precision=32-true",
            f"data.dir={work / 'data'}",
            f"paths.output_dir={work / 'run'}",
            "logger=none",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "trainer.num_sanity_val_steps=0",
            f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={eval_every}",
            f"data.val_windows={val_batches * 16}",
            f"optim.warmup_steps={max(1, steps // 10)}",
            "~callbacks.checkpoint",
            *SIZE,
            *overrides,
        ]
    )


def steadylm_run(cfg) -> list[Point]:
    objects = build(cfg)
    clock = Clock()
    objects["trainer"].callbacks.append(clock)
    objects["trainer"].fit(objects["module"], datamodule=objects["datamodule"])
    return clock.curve


def val_loss(module, loader) -> float:
    """Token-weighted mean cross-entropy over the val loader (its `data.val_windows`), as `val/loss` counts it."""
    ce, n = 0.0, 0
    with torch.no_grad():
        for x, y in loader:
            ce, n = ce + float(module.target_losses(x, y).sum()), n + int((y != IGNORE_INDEX).sum())
    return ce / max(n, 1)


def plain_run(cfg) -> list[Point]:
    """The plain loop on the model and data `build` makes (same init, same order): nothing of Lightning runs."""
    objects = build(cfg)
    module, dm = objects["module"], objects["datamodule"]
    opt = module.configure_optimizers()  # AdamW by the same recipe; the same LR schedule below
    clip, every, steps = cfg.trainer.gradient_clip_val, cfg.trainer.val_check_interval, cfg.trainer.max_steps
    curve, wall, cpu, step = [], 0.0, 0.0, 0
    module.train()
    while step < steps:
        for x, y in dm.train_dataloader():
            start = now()
            loss, _ = module.loss(module.net(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            set_lr(opt, module.schedule(step))
            opt.step()
            opt.zero_grad(set_to_none=True)
            end = now()
            wall, cpu = wall + end[0] - start[0], cpu + end[1] - start[1]
            step += 1
            if step % every == 0:
                module.eval()
                loss = val_loss(module, dm.val_dataloader())
                curve.append((step, wall, cpu, loss))
                module.train()
            if step == steps:
                break
    return curve


def reach(curve: list[Point], target: float) -> Point | None:
    """The first evaluation at or below `target` (to TOLERANCE); None if never."""
    return next((p for p in curve if p[3] <= target + TOLERANCE), None)


def step_cost(cfg, steps: int) -> dict:
    """AdamW and Muon stepping the same weights in turn, each step of one timed right after a step of the other:
    the median optimizer-step share of a training step for each, and the median ratio of whole steps (Muon's
    over the AdamW step just before it) with a 90 % bootstrap interval. Paired, so a busy neighbour slows both."""
    objects = build(cfg)
    module, dm = objects["module"], objects["datamodule"]
    opts = {}
    for name in ("adamw", "muon"):
        module.optim_cfg = {**module.optim_cfg, "name": name}
        opts[name] = module.configure_optimizers()
    share: dict[str, list[float]] = {name: [] for name in opts}
    whole: dict[str, list[float]] = {name: [] for name in opts}
    batches = iter(dm.train_dataloader())
    for i in range(2 * steps + 6):
        name = ("adamw", "muon")[i % 2]
        x, y = next(batches)
        start = time.perf_counter()
        loss, _ = module.loss(module.net(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), cfg.trainer.gradient_clip_val)
        mid = time.perf_counter()
        opts[name].step()
        opts[name].zero_grad(set_to_none=True)
        end = time.perf_counter()
        if i >= 6:  # state allocation and the allocator settle in the first steps
            share[name].append((end - mid) / (end - start))
            whole[name].append(end - start)
    ratio, ratio_90 = median_interval([m / a for a, m in zip(whole["adamw"], whole["muon"])])
    return {**{name: statistics.median(v) for name, v in share.items()}, "step_ratio": ratio, "step_ratio_90": ratio_90}


def median_interval(values: list[float]) -> tuple[float, tuple[float, float]]:
    """The median and a 90 % bootstrap interval for it."""
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(1000))
    return statistics.median(values), (boot[50], boot[949])


def lightning_step_ratio(cfgs: dict, rounds: int) -> dict:
    """A Muon step over an AdamW step through `train.py`'s path (suite on): short fits of each, interleaved, the
    order alternating; per round the ratio of median step times, then the median over rounds with a 90 %
    bootstrap interval. A drift slower than one round (a few seconds) moves both sides alike."""
    ratios = []
    for r in range(rounds):
        medians = {}
        for name in ("adamw", "muon") if r % 2 == 0 else ("muon", "adamw"):
            objects = build(cfgs[name])
            clock = Clock()
            objects["trainer"].callbacks.append(clock)
            objects["trainer"].fit(objects["module"], datamodule=objects["datamodule"])
            medians[name] = statistics.median(clock.steps[3:])  # state allocation settles in the first steps
        ratios.append(medians["muon"] / medians["adamw"])
    ratio, ratio_90 = median_interval(ratios)
    return {"step_ratio": ratio, "step_ratio_90": ratio_90, "rounds": ratios}


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps per run")
    ap.add_argument("--eval-every", type=int, default=25, help="steps between val-loss measurements")
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--adamw-lrs", type=floats, default=floats("1e-3,3e-3,1e-2"))
    ap.add_argument("--muon-lrs", type=floats, default=floats("3e-3,1e-2,2e-2"))
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--step-cost", action="store_true", help="only the optimizer step's share of a step (make bench)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes for the test suite; numbers are not meaningful")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model.d_model=256")
    args = ap.parse_args(argv)
    if args.quick:
        args.steps, args.eval_every, args.val_batches = 20, 10, 2
        args.adamw_lrs, args.muon_lrs = args.adamw_lrs[:1], args.muon_lrs[:1]
        args.overrides = [*QUICK, *args.overrides]
    torch.set_num_threads(args.threads)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="steadylm-ttl-"))
    prepare(input=None, out_dir=work / "data", max_bytes=300_000 if args.quick else 3_000_000, progress=False)

    def cfg(*extra: str):
        return config(work, args.steps, args.eval_every, args.val_batches, [*args.overrides, *extra])

    if args.step_cost:
        share = step_cost(cfg("optim=muon"), 10 if args.quick else 40)
        print(
            f"optimizer step / training step: muon {share['muon']:.3f}, adamw {share['adamw']:.3f}; "
            f"a Muon step / an AdamW step {share['step_ratio']:.3f} "
            f"[{share['step_ratio_90'][0]:.3f}, {share['step_ratio_90'][1]:.3f}] "
            f"({args.threads} thread(s); {' '.join(SIZE + args.overrides)})"
        )
        return share

    runs: dict[str, dict[float, list]] = {"adamw": {}, "muon": {}}
    for name, lrs in (("adamw", args.adamw_lrs), ("muon", args.muon_lrs)):
        for lr in lrs:
            print(f"steadylm {name} lr={lr:g} …", file=sys.stderr)
            runs[name][lr] = steadylm_run(cfg(f"optim={name}", f"optim.lr={lr}"))
    best = {name: min(curves, key=lambda lr: curves[lr][-1][3]) for name, curves in runs.items()}
    print(f"plain loop adamw lr={best['adamw']:g} …", file=sys.stderr)
    plain = plain_run(cfg("optim=adamw", f"optim.lr={best['adamw']}"))
    target = runs["adamw"][best["adamw"]][-1][3]
    rows = {
        "steadylm adamw": (best["adamw"], runs["adamw"][best["adamw"]]),
        "steadylm muon": (best["muon"], runs["muon"][best["muon"]]),
        "plain loop adamw": (best["adamw"], plain),
    }
    base = reach(rows["steadylm adamw"][1], target)
    sweep = {n: {lr: c[-1][3] for lr, c in curves.items()} for n, curves in runs.items()}
    results = {"target_val_loss": target, "best_lr": best, "sweep_final_val_loss": sweep, "rows": {}}
    results["threads"], results["size"] = args.threads, SIZE + args.overrides
    print(f"\ntarget: val loss {target:.4f} = steadylm AdamW's after {args.steps} steps at its best LR")
    print(f"size: {' '.join(SIZE + args.overrides)}; {args.threads} thread(s)")
    for n, d in sweep.items():
        print(f"LR sweep {n}, final val loss: " + ", ".join(f"{lr:g}: {v:.4f}" for lr, v in d.items()))
    head = ("run", "lr", "final", "steps", "wall s", "cpu s", "ms/step", "steps x", "wall x", "cpu x")
    print("{:<17} {:>7} {:>7} {:>6} {:>7} {:>7} {:>8} {:>8} {:>7} {:>7}".format(*head))
    for name, (lr, curve) in rows.items():
        hit = reach(curve, target)
        ratios = [hit[k] / base[k] if hit else math.nan for k in range(3)]
        step, wall, cpu = hit[:3] if hit else ("-", math.nan, math.nan)
        ms = 1e3 * curve[-1][1] / curve[-1][0]
        print(
            f"{name:<17} {lr:>7g} {curve[-1][3]:>7.4f} {step:>6} {wall:>7.1f} {cpu:>7.1f} {ms:>8.1f} "
            + " ".join(f"{r:>7.3f}" for r in ratios)
        )
        results["rows"][name] = {"lr": lr, "curve": curve, "reached": hit, "ratios_steps_wall_cpu": ratios}
    # The wall ratios above come from runs one after the other, which a busy neighbour moves by +-10 % (four runs
    # of the same code gave 0.62x to 0.77x): the steps are exact, the cost per step is measured interleaved.
    muon_hit = reach(rows["steadylm muon"][1], target)
    steps_x = muon_hit[0] / base[0] if muon_hit else math.nan
    short = 10 if args.quick else 40
    cost = lightning_step_ratio(
        {n: config(work, short, short, 1, [*args.overrides, f"optim={n}", f"optim.lr={best[n]}"]) for n in best},
        2 if args.quick else 8,
    )
    low, high = cost["step_ratio_90"]
    results["paired"] = {**cost, "steps_x": steps_x, "wall_x": steps_x * cost["step_ratio"]}
    print(
        f"interleaved: a Muon step costs {cost['step_ratio']:.3f}x an AdamW step [{low:.3f}, {high:.3f}] "
        f"({len(cost['rounds'])} rounds of {short}-step fits each, suite on), so Muon's wall time to the target "
        f"is {steps_x:.3f} x {cost['step_ratio']:.3f} = {results['paired']['wall_x']:.3f}x "
        f"[{steps_x * low:.3f}, {steps_x * high:.3f}]"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
