"""Speed of the model families, side by side in one process: `python benchmarks/model_bench.py [--quick]`.

For each preset (default `tiny` and `llama_tiny`), on the same batch:

  steadylm     training steps through `train.py`'s own path (`build` + `trainer.fit`, default callbacks)
  raw loop     the plain PyTorch loop on the same model object: forward, cross-entropy, backward,
               clip, fused AdamW step, zero_grad; nothing else

It prints tokens/s of each; steadylm / raw in tokens/s (the cost of the training framework on that
family), as the median of per-step ratios, each Lightning step paired with a raw step run right after
it; and llama_tiny / tiny in tokens/s for both paths (the cost of the Llama switches themselves): raw
steps of the presets alternate step by step, and the steadylm ratio is that times the two presets'
steadylm / raw ratios, so every ratio printed comes from steps that ran back to back. The tokens/s
columns are plain medians, and on a shared machine they move with its load; the ratios are the result.

Usage: python benchmarks/model_bench.py [--quick] [--rounds N] [--steps N] [--models tiny,llama_tiny]
       [--json FILE] [overrides...]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `bench`, also when loaded by file path (the test)
from bench import with_keys  # noqa: E402

from steadylm.config import compose  # noqa: E402
from steadylm.data.prepare import prepare  # noqa: E402
from steadylm.train import build, build_trainer  # noqa: E402

WARMUP = 3  # steps dropped from each timed run: allocator and optimizer state settle there


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class RawLoop:
    """The loop a nanoGPT user writes, on the same model object and batch: forward, cross-entropy,
    backward, clip, fused AdamW step, zero_grad. Its own optimizer; the weights it moves are shared."""

    def __init__(self, cfg, net: torch.nn.Module, batch):
        self.net = net
        self.device = next(net.parameters()).device
        self.x, self.y = (t.to(self.device) for t in batch)
        o = cfg.optim
        self.opt = torch.optim.AdamW(
            net.parameters(),
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
            fused=self.device.type in ("cuda", "cpu"),
        )
        bf16 = str(cfg.trainer.precision).startswith("bf16")
        self.autocast = (
            (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
        )
        self.clip = cfg.trainer.gradient_clip_val

    def step(self) -> float:
        """One timed step (seconds)."""
        was_training = self.net.training
        self.net.train()
        _sync(self.device)
        t = time.perf_counter()
        with self.autocast():
            logits = self.net(self.x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), self.y.reshape(-1), ignore_index=-100)
        loss.backward()
        if self.clip:
            torch.nn.utils.clip_grad_norm_(self.net.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        _sync(self.device)
        self.net.train(was_training)
        return time.perf_counter() - t


class StepStart(L.Callback):
    """First in the callback list: the step's clock starts before any other callback's batch-start hook."""

    def __init__(self) -> None:
        self.t = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        _sync(pl_module.device)
        self.t = time.perf_counter()


class PairedSteps(L.Callback):
    """Last in the callback list: stops the clock after every other callback's batch-end hook, then runs
    and times one raw step outside the Lightning step, so a slow spell on a shared machine hits both
    sides of a pair alike. (Fetching the batch is outside both: the raw loop reuses one batch.)"""

    def __init__(self, raw: RawLoop) -> None:
        self.raw = raw
        self.start = StepStart()
        self.pairs: list[tuple[float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        _sync(pl_module.device)
        lightning = time.perf_counter() - self.start.t
        self.pairs.append((lightning, self.raw.step()))


def paired_run(cfg, objs, batch, steps: int) -> list[tuple[float, float]]:
    """One `trainer.fit` of `steps` steps of train.py's path, each paired with a raw step."""
    trainer = build_trainer(with_keys(objs["run"], {"trainer.max_steps": steps}))
    paired = PairedSteps(RawLoop(cfg, objs["module"].net, batch))
    trainer.callbacks.insert(0, paired.start)
    trainer.callbacks.append(paired)
    trainer.fit(objs["module"], datamodule=objs["datamodule"])
    return paired.pairs[WARMUP:]


def raw_alternating(loops: dict[str, RawLoop], steps: int) -> dict[str, list[float]]:
    """Raw steps of every preset in turn, step by step: the fairest family-vs-family comparison."""
    times: dict[str, list[float]] = {n: [] for n in loops}
    for i in range(steps):
        for name, loop in loops.items():
            t = loop.step()
            if i >= WARMUP:
                times[name].append(t)
    return times


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few short rounds, for the test suite; ratios are rough")
    ap.add_argument("--rounds", type=int, help="default 4 (--quick: 2)")
    ap.add_argument(
        "--steps", type=int, help="steps per path per round, the first 3 not timed; default 40 (--quick: 8)"
    )
    ap.add_argument(
        "--models", default="tiny,llama_tiny", help="comma-separated model presets; the first is the baseline"
    )
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides for every preset, e.g. data.batch_size=32")
    args = ap.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 4)
    args.steps = max(args.steps or (8 if args.quick else 40), WARMUP + 1)
    logging.getLogger("lightning").setLevel(logging.WARNING)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    models = args.models.split(",")
    gpu = torch.cuda.is_available()

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "shards"
        prepare(
            input=None, out_dir=data, max_bytes=300_000 if args.quick else 2_000_000, val_fraction=0.05, progress=False
        )
        setups = {}
        for name in models:
            cfg = compose(
                [
                    f"model={name}",
                    f"trainer={'gpu' if gpu else 'cpu'}",
                    f"trainer.precision={'bf16-mixed' if gpu else '32-true'}",
                    f"data.dir={data}",
                    f"paths.output_dir={Path(tmp) / name}",
                    "logger=none",
                    "trainer.limit_val_batches=0",
                    "trainer.enable_progress_bar=false",
                    "trainer.enable_model_summary=false",
                    "optim.warmup_steps=1",
                    "callbacks.checkpoint.every_n_train_steps=100000",
                    "callbacks.checkpoint.save_last=false",
                    *args.overrides,
                ]
            )
            objs = build(cfg)
            batch = next(iter(objs["datamodule"].train_dataloader()))
            setups[name] = (cfg, objs, batch)
        pairs: dict[str, list[tuple[float, float]]] = {n: [] for n in models}
        alternating: dict[str, list[float]] = {n: [] for n in models}
        for _ in range(args.rounds):  # presets alternate by round (steadylm) and by step (raw)
            for name in models:
                cfg, objs, batch = setups[name]
                pairs[name] += paired_run(cfg, objs, batch, args.steps)
            loops = {n: RawLoop(setups[n][0], setups[n][1]["module"].net, setups[n][2]) for n in models}
            for name, t in raw_alternating(loops, args.steps).items():
                alternating[name] += t

    results = {}
    for name in models:
        cfg, objs, batch = setups[name]
        tokens = batch[0].numel()
        lightning, raw = zip(*pairs[name])
        results[name] = {
            "params": objs["module"].net.num_params(),
            "tokens_per_step": tokens,
            "tokens_per_s": {"steadylm": tokens / statistics.median(lightning), "raw": tokens / statistics.median(raw)},
            # per-pair ratios: each pair ran back to back under the same machine load
            "steadylm_over_raw": statistics.median(raw_t / lit_t for lit_t, raw_t in pairs[name]),
            "raw_alternating_tokens_per_s": tokens / statistics.median(alternating[name]),
        }
    base = models[0]
    for name in models[1:]:
        raw = statistics.median(b / a for a, b in zip(alternating[name], alternating[base]))
        # Built from paired measurements only: preset/base on the raw loop (step-by-step alternation), times
        # each preset's own steadylm/raw (per-step pairs). Dividing medians from different rounds would
        # compare two moments of a shared machine's load instead.
        frame = results[name]["steadylm_over_raw"] / results[base]["steadylm_over_raw"]
        results[name]["vs_" + base] = {"steadylm": raw * frame, "raw": raw}
    report(results, models, "cuda" if gpu else "cpu", args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


def report(results: dict, models: list[str], device: str, args) -> None:
    base = models[0]
    print(
        f"\nmodel_bench on {device}: median of {args.rounds} rounds x {args.steps - WARMUP} timed steps per path"
        + (" (--quick: rough)" if args.quick else "")
    )
    print(
        f"{'model':<14}{'params':>12}{'steadylm tok/s':>17}{'raw tok/s':>12}{'steadylm/raw':>14}"
        f"{'  tok/s vs ' + base + ' (steadylm, raw)':>34}"
    )
    for name in models:
        r = results[name]
        vs = r.get("vs_" + base)
        rel = f"{vs['steadylm']:.3f}, {vs['raw']:.3f}" if vs else "1, 1"
        print(
            f"{name:<14}{r['params']:>12,}{r['tokens_per_s']['steadylm']:>17,.0f}{r['tokens_per_s']['raw']:>12,.0f}"
            f"{r['steadylm_over_raw']:>14.3f}{rel:>34}"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
