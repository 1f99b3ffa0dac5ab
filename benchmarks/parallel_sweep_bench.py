"""A parallel sweep against the same sweep in sequence, side by side: 4 one-thread jobs (4 LRs) on 2 slots.

  sequence   python train.py -m optim.lr=a,b,c,d trainer=cpu ...                    (one process, jobs in turn)
  parallel   the same + hydra/launcher=parallel hydra.launcher.slots=2                (a process a job, 2 at once)

Both as a user runs them (whole commands, start-up included), OMP_NUM_THREADS=1, on a small prepared slice of the
embedded corpus. The two run in pairs, interleaved (sequence first in even pairs, parallel first in odd ones), so a
machine whose speed drifts moves both; each pair gives the wall time ratio parallel / sequence, and the last line
their mean with a 95 % t-interval over the pairs; the same for CPU time (every process each command started), which
shows what the parallel launcher adds: a process start per job (Python, torch, Lightning, the config) where the
sequence starts one. Every sweep's summary must list 4 finished jobs. First it measures what two one-thread processes
at once get done against one (2.00 on two idle cores): the wall ratio tends to 1 / that as jobs grow longer than
their start, 0.5 on two idle cores.

Usage: python benchmarks/parallel_sweep_bench.py [--pairs 3] [--steps 2000] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from steadylm.data.prepare import prepare  # noqa: E402

T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26}  # two-sided t, df = pairs-1

JOB = [
    "trainer=cpu",
    "model.n_layer=2",
    "model.d_model=64",
    "model.n_head=2",
    "model.context_length=64",
    "data.batch_size=8",
    "optim.warmup_steps=10",
    "data.val_windows=64",
    "trainer.enable_progress_bar=false",
    "optim.lr=1e-3,2e-3,3e-3,4e-3",
]


def sweep(args: list[str], root: Path) -> tuple[float, float]:
    """Wall and CPU seconds (every process it started, reaped) of one whole `python train.py -m ...` in its own
    folder; its summary must list 4 ok jobs."""
    root.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STEADYLM_ROOT": str(root)}
    env.pop("HYDRA_FULL_ERROR", None)
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "-m", *args], cwd=root, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    if done.returncode or "(4 jobs, 0 unstable, 0 diverged)" not in done.stdout:
        sys.exit(f"sweep failed (exit {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (cpu.ru_utime + cpu.ru_stime)


SPIN = "import time; t = time.perf_counter(); x = 0\nfor i in range(20_000_000): x += i\nprint(time.perf_counter() - t)"


def capacity() -> float:
    """What two one-thread processes at once get done against one alone (2.0 on two idle cores): the most a parallel
    sweep on 2 slots can gain on the cores at hand."""

    def spin(n: int) -> float:
        procs = [subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True) for _ in range(n)]
        return max(float(p.communicate()[0]) for p in procs)

    return statistics.median(2 * spin(1) / spin(2) for _ in range(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prepare(input=None, out_dir=tmp / "shards", max_bytes=400_000, val_fraction=0.05, progress=False)
        job = [
            *JOB,
            f"data.dir={tmp / 'shards'}",
            f"trainer.max_steps={opts.steps}",
            f"trainer.val_check_interval={opts.steps}",
        ]
        kinds = {"sequence": job, "parallel": [*job, "hydra/launcher=parallel", "hydra.launcher.slots=2"]}
        print(f"two processes at once do {capacity():.2f}x the work of one (2.00 on two idle cores)")
        print(f"4 jobs x {opts.steps} steps, 1 thread each; {opts.pairs} pairs, interleaved")
        rows = []
        for pair in range(opts.pairs):
            walls, cpus = {}, {}
            for kind in ("sequence", "parallel") if pair % 2 == 0 else ("parallel", "sequence"):
                walls[kind], cpus[kind] = sweep(kinds[kind], tmp / f"{kind}{pair}")
            rows.append({**walls, "ratio": walls["parallel"] / walls["sequence"]})
            rows[-1]["cpu"], rows[-1]["cpu_ratio"] = cpus, cpus["parallel"] / cpus["sequence"]
            print(
                f"pair {pair}: wall sequence {walls['sequence']:6.1f} s  parallel {walls['parallel']:6.1f} s  "
                f"ratio {rows[-1]['ratio']:.3f};  CPU sequence {cpus['sequence']:6.1f} s  parallel "
                f"{cpus['parallel']:6.1f} s  ratio {rows[-1]['cpu_ratio']:.3f}"
            )
    for key, what in (("cpu_ratio", "CPU time (process starts)"), ("ratio", "wall time")):
        mean, half = interval([r[key] for r in rows])
        print(f"parallel / sequence {what}: {mean:.3f} ± {half:.3f} (95 % t-interval, {len(rows)} pairs)")
    if opts.json:
        opts.json.write_text(json.dumps({"steps": opts.steps, "pairs": rows}, indent=2))


def interval(ratios: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95 % t-interval."""
    mean = statistics.fmean(ratios)
    half = (
        T95.get(len(ratios) - 1, 2.0) * statistics.stdev(ratios) / len(ratios) ** 0.5
        if len(ratios) > 1
        else float("nan")
    )
    return mean, half


if __name__ == "__main__":
    main()
