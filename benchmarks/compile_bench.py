"""`compile=true` against eager on the CPU, through `train.py` itself, compile time included.

Each round runs the same short fit twice, eager and compiled, in alternating order, at nanoGPT's benchmark shape
(4 layers, d 256, 4 heads, context 256, batch 16, fp32, the suite on) on one thread each, and times the whole
process: start-up, compiling (from an empty inductor cache), every step and the final validation. Printed: each mode's median wall time, the
compiled/eager ratio per round with its range over the rounds, and the step count at which compiling pays off
(from the per-step time of each, measured as the wall time of a longer fit minus a shorter one's).

Usage: python benchmarks/compile_bench.py [--rounds 2] [--steps 40 120] [--data DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["model.n_layer=4", "model.d_model=256", "model.n_head=4", "model.context_length=256", "data.batch_size=16"]


def fit(out: Path, steps: int, compiled: bool, data: Path) -> float:
    """Seconds of one `python train.py` of `steps` steps, compiled or not."""
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        f"hydra.run.dir={out}",
        f"data.dir={data}",
        *SHAPE,
        "trainer.precision=32-true",
        f"trainer.max_steps={steps}",
        f"trainer.val_check_interval={steps}",
        "data.val_windows=64",
        "trainer.enable_progress_bar=false",
        f"compile={str(compiled).lower()}",
    ]
    # A cache of its own: every compiled run compiles from nothing, as a user's first run of a model does.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor")}
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, nargs=2, default=[40, 120], metavar=("SHORT", "LONG"))
    ap.add_argument("--data", type=Path, default=ROOT / "data" / "stdlib-bytes")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not any(args.data.glob("*.h5")):
        raise SystemExit(f"error: --data {args.data} has no shards; run `make data` first")
    short, long = args.steps
    times: dict[tuple[bool, int], list[float]] = {(c, s): [] for c in (False, True) for s in (short, long)}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for steps in (short, long):
                for compiled in (False, True) if r % 2 == 0 else (True, False):
                    t = fit(Path(tmp) / f"r{r}-{steps}-{compiled}", steps, compiled, args.data)
                    times[(compiled, steps)].append(t)
                    print(f"round {r + 1}: {steps} steps, compile={compiled}: {t:.1f} s", file=sys.stderr, flush=True)
    ratios = [c / e for c, e in zip(times[(True, long)], times[(False, long)])]
    med = {k: statistics.median(v) for k, v in times.items()}
    per_step = {c: (med[(c, long)] - med[(c, short)]) / (long - short) for c in (False, True)}
    fixed = {c: med[(c, short)] - short * per_step[c] for c in (False, True)}
    gain = per_step[False] - per_step[True]
    pays = (fixed[True] - fixed[False]) / gain if gain > 0 else None
    print(f"\n{long}-step fit, whole process: eager {med[(False, long)]:.1f} s, compiled {med[(True, long)]:.1f} s")
    print(
        f"compiled / eager: {statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} rounds)"
    )
    print(f"per step: eager {per_step[False] * 1e3:.1f} ms, compiled {per_step[True] * 1e3:.1f} ms")
    print(
        f"start-up and compiling: eager {fixed[False]:.1f} s, compiled {fixed[True]:.1f} s; compiling pays off "
        + (f"after {pays:.0f} steps" if pays is not None else "never (no faster per step)")
    )
    if args.json:
        out = {"ratio": ratios, "per_step_s": per_step, "fixed_s": fixed, "pays_after_steps": pays}
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
