"""Packed documents with masked attention (`data.pack=doc`) against windows that run across documents
(`data.pack=none`, the default) and windows per document with padding (`data.align=doc`), side by side.

Two corpora, each prepared with `prepare` (bytes): documents short by nature (the standard library's source files
under --short-bytes, one document each) and the embedded corpus (whole stdlib files, mostly long). For each corpus,
variant and seed, `train.py`'s `train()` at tiny's shape for --steps steps, then two val losses on the same val
windows: the run's own `val/loss` (each variant as it trains and validates) and the per-document one, every run
scored with documents masked apart (a document sees only itself, as it would at inference): the fair column.

Step time: the packed (masked) step against the unmasked one on the same model and batches, a pair of plain steps at
a time in a seeded random order (bench.py's `paired_ratios`, 90 % bootstrap interval), once for each attention kernel
that serves packed documents on the device (`model.gpt.doc_kernel`: the explicit mask everywhere, FlexAttention's
block mask on CUDA); the kernel column says which one training chose at startup. `data.align=doc` costs no step
time; its cost is the padding, shown as the share of targets that train. `--trainer gpu` runs it all on a GPU.

Usage: python benchmarks/pack_bench.py [--steps 300] [--seeds 1,2] [--short-bytes 2000] [--pairs 60] [--context 128]
       [--batch 16] [--trainer cpu|gpu] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import sys
import sysconfig
import tempfile
from pathlib import Path

import torch
from bench import paired_ratios, raw_step

from steadylm.config import compose
from steadylm.data.prepare import prepare
from steadylm.model.gpt import IGNORE_INDEX
from steadylm.train import build, train

VARIANTS = {"pack=none": [], "pack=doc": ["data.pack=doc"], "align=doc": ["data.align=doc"]}
KERNELS = {"cpu": ["mask"], "cuda": ["mask", "flex"]}  # what serves packed documents on each device (doc_kernel)


def short_corpus(out: Path, limit: int) -> Path:
    """The standard library's .py files of at most `limit` bytes, copied flat into `out/text` (one document each)."""
    text = out / "text"
    text.mkdir(parents=True)
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py") if "site-packages" not in p.parts and 0 < p.stat().st_size <= limit)
    for i, path in enumerate(files):
        shutil.copyfile(path, text / f"{i:05d}.txt")
    return text


def run(data: Path, work: Path, variant: list[str], seed: int, steps: int, shape: list[str], trainer: str) -> dict:
    cfg = compose(
        [
            *shape,
            f"trainer={trainer}",
            "trainer.precision=32-true",
            f"data.dir={data}",
            f"paths.output_dir={work}",
            f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={steps}",
            "data.val_windows=null",
            "logger=none",
            "~callbacks.checkpoint",
            "trainer.enable_progress_bar=false",
            f"seed={seed}",
            *variant,
        ]
    )
    metrics, objects = train(cfg)
    module, dm = objects["module"], objects["datamodule"]
    kernel = module.net.doc_kernel if module.net.doc_separator is not None else "causal"  # causal: SDPA's is_causal
    module.net.doc_separator = dm.infos["train"][0].eos_id  # every run scored per document
    per_doc = objects["trainer"].validate(module, datamodule=dm, verbose=False)[0]["val/loss"]
    loader = dm.train_dataloader()
    targets = [int((y != IGNORE_INDEX).sum()) / y.numel() for _, (_, y) in zip(range(20), loader)]
    share = statistics.mean(targets)
    return {"val_loss": metrics["val/loss"], "per_doc_val_loss": per_doc, "target_share": share, "kernel": kernel}


def step_ratios(data: Path, work: Path, pairs: int, shape: list[str], trainer: str) -> dict[str, tuple]:
    """Masked / unmasked step time on one model and one stream of batches, for each kernel the device serves."""
    base = [f"data.dir={data}", f"paths.output_dir={work}", "logger=none"]
    cfg = compose([*shape, f"trainer={trainer}", "trainer.precision=32-true", *base])
    objects = build(cfg)
    module, dm = objects["module"], objects["datamodule"]
    device = torch.device("cuda" if trainer == "gpu" else "cpu")
    module.to(device)
    eos, opt = dm.infos["train"][0].eos_id, module.configure_optimizers()
    batches = (tuple(t.to(device) for t in b) for b in _endless(dm))

    def step(separator, kernel="mask"):
        def go():
            module.net.doc_separator, module.net.doc_kernel = separator, kernel
            raw_step(module, opt, lambda: 1e-4, next(batches), 1.0)
            if device.type == "cuda":
                torch.cuda.synchronize()

        return go

    return {kernel: paired_ratios(step(eos, kernel), step(None), pairs)[:3] for kernel in KERNELS[device.type]}


def _endless(dm):
    while True:
        yield from dm.train_dataloader()


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--short-bytes", type=int, default=2000)
    ap.add_argument("--max-bytes", type=int, default=2_000_000, help="of each corpus")
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--context", type=int, default=128, help="model.context_length (tiny's)")
    ap.add_argument("--batch", type=int, default=16, help="data.batch_size (tiny's)")
    ap.add_argument("--trainer", choices=["cpu", "gpu"], default="cpu", help="conf/trainer preset (gpu: one CUDA GPU)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    work = Path(tempfile.mkdtemp(prefix="steadylm-pack-"))
    corpora = {"short files": work / "short", "embedded corpus": work / "stdlib"}
    text = short_corpus(work / "short-text", args.short_bytes)
    for name, (source, out) in {
        "short files": (text, corpora["short files"]),
        "embedded corpus": (None, corpora["embedded corpus"]),
    }.items():
        kw = {"on_bad_record": "skip"}  # a few stdlib test files are Latin-1 on purpose
        summary = prepare(
            source and str(source), out, max_bytes=args.max_bytes, val_fraction=0.05, progress=False, **kw
        )
        print(
            f"{name}: {sum(summary['documents'].values()):,} documents, {sum(summary['tokens'].values()):,} tokens",
            file=sys.stderr,
        )
    shape = [f"model.context_length={args.context}", f"data.batch_size={args.batch}"]
    results = {"steps": args.steps, "context": args.context, "batch": args.batch, "trainer": args.trainer}
    results["corpora"] = {}
    for name, data in corpora.items():
        rows = {}
        for variant, keys in VARIANTS.items():
            runs = [
                run(data, work / f"run{len(rows)}-{s}-{name.split()[0]}", keys, s, args.steps, shape, args.trainer)
                for s in map(int, args.seeds.split(","))
            ]
            rows[variant] = {k: [r[k] for r in runs] for k in runs[0]}
            print(f"  {name}, {variant}: done", file=sys.stderr)
        ratios = step_ratios(data, work / f"ratio-{name.split()[0]}", args.pairs, shape, args.trainer)
        chosen = rows["pack=doc"]["kernel"][0]  # the masked step as training runs it, and every kernel measured
        results["corpora"][name] = {"rows": rows, "masked_over_unmasked_step": ratios[chosen], "kernels": ratios}
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


def report(results: dict) -> None:
    seeds = len(next(iter(next(iter(results["corpora"].values()))["rows"].values()))["val_loss"])
    shape = f"tiny's model at context {results['context']}, batch {results['batch']}"
    print(f"\nval loss after {results['steps']} steps, {shape}, mean of {seeds} seeds (min-max):")
    head = f"{'own val/loss':>22} {'per-document val loss':>24} {'targets trained':>16} {'kernel':>7}"
    print(f"{'corpus':16} {'variant':10} {head}")
    for name, c in results["corpora"].items():
        for variant, r in c["rows"].items():
            own, doc = r["val_loss"], r["per_doc_val_loss"]
            cells = [f"{statistics.mean(v):.4f} ({min(v):.4f}-{max(v):.4f})" for v in (own, doc)]
            share = statistics.mean(r["target_share"])
            print(f"{name:16} {variant:10} {cells[0]:>22} {cells[1]:>24} {share:>15.1%} {r['kernel'][0]:>7}")
    device = "a GPU" if results.get("trainer") == "gpu" else "a CPU"
    for name, c in results["corpora"].items():
        for kernel, (v, lo, hi) in c["kernels"].items():
            print(
                f"step time, {name}: pack=doc ({kernel}) / pack=none {v:.3f} [{lo:.3f}, {hi:.3f}] "
                f"(paired, 90 % interval, on {device})"
            )


if __name__ == "__main__":
    main()
