"""The natural-divergence table (issue 22): the seed's first causes, as a new user meets them, with the default
suite and without its mitigation, against the stable run of the same seed.

Each row is a real `python train.py` run of the tiny model without QK-norm on the embedded corpus (`--steps`
steps, default callbacks); the unmitigated column adds `callbacks.stability.qk_clip=null`. Every run's
`result.json` gives its status and final val loss; the table prints each loss, its gap to the stable LR's run
of the same seed, and the events that acted (clips, LR backoffs, rewinds). Runs go `--jobs` at a time, each on
one thread: losses do not depend on the machine's load, only on the seed and the thread count.

Usage: python benchmarks/natural_divergence.py [--steps N (400)] [--seeds 1337,1] [--jobs 2] [--quick]
       [--cases 10x,30x,warmup] [--variant NAME=OVERRIDES ...] [overrides...]
--variant adds a policy column, e.g. --variant "window=callbacks.stability.qk_clip.backoff_after=3".
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from steadylm.stability import read_events  # noqa: E402

CASES = {
    "optim.lr=3e-3 (stable)": ["optim.lr=3e-3"],
    "optim.lr=0.03 (10x)": ["optim.lr=0.03"],
    "optim.lr=0.1 (30x)": ["optim.lr=0.1"],
    "lr 0.05, no warmup, no clipping": ["optim.lr=0.05", "optim.warmup_steps=0", "trainer.gradient_clip_val=0"],
}
STABLE = "optim.lr=3e-3 (stable)"
UNMITIGATED = ["callbacks.stability.qk_clip=null"]


def run(out: Path, overrides: list[str]) -> dict:
    """One `train.py` run; its result.json and the events that acted."""
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={out}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    result = out / "result.json"
    if not result.exists():
        raise SystemExit(f"error: {shlex.join(cmd)} wrote no result.json:\n{proc.stderr[-2000:]}")
    r = json.loads(result.read_text())
    kinds = [e["kind"] for e in read_events(out)] if (out / "stability").exists() else []
    r["acted"] = {k: kinds.count(k) for k in ("qk_clip", "lr_backoff", "rollback") if k in kinds}
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--seeds", default="1337", help="comma-separated seeds; the gap is to the same seed's stable run")
    ap.add_argument("--jobs", type=int, default=2, help="runs at a time, one thread each")
    ap.add_argument("--quick", action="store_true", help="a few steps of a smaller model: the test suite's check")
    ap.add_argument("--variant", action="append", default=[], help="NAME=space-separated overrides: a policy column")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument(
        "--cases", help="comma-separated words: only the cases whose name holds one (the stable one always)"
    )
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    base = ["model.qk_norm=false", f"trainer.max_steps={args.steps}", "trainer.enable_progress_bar=false"]
    if args.quick:
        base += [
            "model.d_model=32",
            "model.n_head=2",
            "model.context_length=32",
            "data.val_windows=32",
        ]
        base += [f"optim.warmup_steps={args.steps // 4}", f"trainer.val_check_interval={args.steps}"]
    columns = {"default": [], "unmitigated": UNMITIGATED}
    for v in args.variant:
        name, _, overrides = v.partition("=")
        columns[name] = overrides.split()
    work = Path(tempfile.mkdtemp(prefix="steadylm-natural-"))
    jobs = [
        (case, col, seed)
        for seed in seeds
        for case in CASES
        for col in columns
        if not (case == STABLE and col != "default")  # a stable run has nothing to mitigate
        and (case == STABLE or not args.cases or any(w in case for w in args.cases.split(",")))
    ]

    def one(job):
        case, col, seed = job
        out = work / f"{seed}-{list(CASES).index(case)}-{col}"
        return job, run(out, [*base, *CASES[case], *columns[col], f"seed={seed}", *args.overrides])

    print(f"{len(jobs)} runs of {args.steps} steps, {args.jobs} at a time, under {work} …", file=sys.stderr)
    results = {}
    with ThreadPoolExecutor(args.jobs) as pool:
        for n, (job, r) in enumerate(pool.map(one, jobs), 1):
            results[job] = r
            print(f"  {n}/{len(jobs)} {job}: {r['status']} {r['val_loss']:.3f}", file=sys.stderr)
    print(f"\ntiny model, model.qk_norm=false, {args.steps} steps, seeds {seeds}: val loss (gap to the stable run)")
    print(f"{'run':34}" + "".join(f" {c:>26}" for c in columns))
    for case in CASES:
        cells = []
        for col in columns:
            rs = [(results.get((case, col, s)), results[(STABLE, "default", s)]) for s in seeds]
            if rs[0][0] is None:
                cells.append(f"{'—':>26}")
                continue
            gaps = [r["val_loss"] / stable["val_loss"] - 1 for r, stable in rs]
            loss = statistics.mean(r["val_loss"] for r, _ in rs)
            status = "/".join(sorted({r["status"] for r, _ in rs}))
            cells.append(f" {loss:6.3f} ({statistics.mean(gaps):+6.1%}) {status:>10}")
        print(f"{case:34}" + "".join(cells))
    print("\nper run (seed: loss, status, events that acted):")
    for (case, col, seed), r in results.items():
        print(f"  {case:34} {col:12} {seed:>5}: {r['val_loss']:.3f} {r['status']:9} {r['acted']}")
    if args.json:
        args.json.write_text(json.dumps([[*k, v] for k, v in results.items()], indent=2))


if __name__ == "__main__":
    main()
