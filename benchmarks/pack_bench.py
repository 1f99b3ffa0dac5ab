"""Packed documents with masked attention (`data.pack=doc`) against windows that run across documents
(`data.pack=none`, the default) and windows per document with padding (`data.align=doc`), side by side.

Two corpora, each prepared with `prepare` (bytes): documents short by nature (the standard library's source files
under --short-bytes, one document each) and the embedded corpus (whole stdlib files, mostly long). For each corpus,
variant and seed, `train.py`'s `train()` at tiny's shape for --steps steps, then two val losses on the same val
windows: the run's own `val/loss` (each variant as it trains and validates) and the per-document one, every run
scored with documents masked apart (a document sees only itself, as it would at inference): the fair column.

Step time: the packed (masked) step against the unmasked one on the same model and batches, a pair of plain steps at
a time in a seeded random order (bench.py's `paired_ratios`, 90 % bootstrap interval). `data.align=doc` costs no
step time; its cost is the padding, shown as the share of targets that train.

Usage: python benchmarks/pack_bench.py [--steps 300] [--seeds 1,2] [--short-bytes 2000] [--pairs 60] [--context 128]
       [--batch 16] [--json FILE]
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

from bench import paired_ratios, raw_step

from steadylm.config import compose
from steadylm.data.prepare import prepare
from steadylm.model.gpt import IGNORE_INDEX
from steadylm.train import build, train

VARIANTS = {"pack=none": [], "pack=doc": ["data.pack=doc"], "align=doc": ["data.align=doc"]}


def short_corpus(out: Path, limit: int) -> Path:
    """The standard library's .py files of at most `limit` bytes, copied flat into `out/text` (one document each)."""
    text = out / "text"
    text.mkdir(parents=True)
    lib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in lib.rglob("*.py") if "site-packages" not in p.parts and 0 < p.stat().st_size <= limit)
    for i, path in enumerate(files):
        shutil.copyfile(path, text / f"{i:05d}.txt")
    return text


def run(data: Path, work: Path, variant: list[str], seed: int, steps: int, shape: list[str]) -> dict:
    cfg = compose(
        [
            *shape,
            "trainer=cpu",
            "trainer.precision=32-true",
            f"data.dir={data}",
            f"paths.output_dir={work}",
            f"trainer.max_steps={steps}",
            f"trainer.val_check_interval={steps}",
            "trainer.limit_val_batches=1.0",
            "logger=none",
            "~callbacks.checkpoint",
            "trainer.enable_progress_bar=false",
            f"seed={seed}",
            *variant,
        ]
    )
    metrics, objects = train(cfg)
    module, dm = objects["module"], objects["datamodule"]
    module.net.doc_separator = dm.infos["train"][0].eos_id  # every run scored per document
    per_doc = objects["trainer"].validate(module, datamodule=dm, verbose=False)[0]["val/loss"]
    loader = dm.train_dataloader()
    targets = [int((y != IGNORE_INDEX).sum()) / y.numel() for _, (_, y) in zip(range(20), loader)]
    return {"val_loss": metrics["val/loss"], "per_doc_val_loss": per_doc, "target_share": statistics.mean(targets)}


def step_ratio(data: Path, work: Path, pairs: int, shape: list[str]) -> tuple[float, float, float]:
    """Masked / unmasked step time on one model and one stream of batches."""
    base = ["trainer=cpu", "trainer.precision=32-true", f"data.dir={data}", f"paths.output_dir={work}", "logger=none"]
    cfg = compose([*shape, *base])
    objects = build(cfg)
    module, dm = objects["module"], objects["datamodule"]
    eos, opt = dm.infos["train"][0].eos_id, module.configure_optimizers()
    batches = iter(dm.train_dataloader())

    def step(separator):
        def go():
            module.net.doc_separator = separator
            raw_step(module, opt, lambda: 1e-4, next(batches), 1.0)

        return go

    return paired_ratios(step(eos), step(None), pairs)[:3]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--short-bytes", type=int, default=2000)
    ap.add_argument("--max-bytes", type=int, default=2_000_000, help="of each corpus")
    ap.add_argument("--pairs", type=int, default=60)
    ap.add_argument("--context", type=int, default=128, help="model.context_length (tiny's)")
    ap.add_argument("--batch", type=int, default=16, help="data.batch_size (tiny's)")
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
    results = {"steps": args.steps, "context": args.context, "batch": args.batch, "corpora": {}}
    for name, data in corpora.items():
        rows = {}
        for variant, keys in VARIANTS.items():
            runs = [
                run(data, work / f"run{len(rows)}-{s}-{name.split()[0]}", keys, s, args.steps, shape)
                for s in map(int, args.seeds.split(","))
            ]
            rows[variant] = {k: [r[k] for r in runs] for k in runs[0]}
            print(f"  {name}, {variant}: done", file=sys.stderr)
        ratio = step_ratio(data, work / f"ratio-{name.split()[0]}", args.pairs, shape)
        results["corpora"][name] = {"rows": rows, "masked_over_unmasked_step": ratio}
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


def report(results: dict) -> None:
    seeds = len(next(iter(next(iter(results["corpora"].values()))["rows"].values()))["val_loss"])
    shape = f"tiny's model at context {results['context']}, batch {results['batch']}"
    print(f"\nval loss after {results['steps']} steps, {shape}, mean of {seeds} seeds (min-max):")
    print(f"{'corpus':16} {'variant':10} {'own val/loss':>22} {'per-document val loss':>24} {'targets trained':>16}")
    for name, c in results["corpora"].items():
        for variant, r in c["rows"].items():
            own, doc = r["val_loss"], r["per_doc_val_loss"]
            cells = [f"{statistics.mean(v):.4f} ({min(v):.4f}-{max(v):.4f})" for v in (own, doc)]
            share = statistics.mean(r["target_share"])
            print(f"{name:16} {variant:10} {cells[0]:>22} {cells[1]:>24} {share:>15.1%}")
    for name, c in results["corpora"].items():
        v, lo, hi = c["masked_over_unmasked_step"]
        print(f"step time, {name}: pack=doc / pack=none {v:.3f} [{lo:.3f}, {hi:.3f}] (paired, 90 % interval)")


if __name__ == "__main__":
    main()
