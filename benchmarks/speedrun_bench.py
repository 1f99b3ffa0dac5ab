"""The speedrun contribution table: each technique alone against one baseline, by steps and wall time to a fixed
val loss over several seeds, and the stacked preset (`experiment=fast`) against the baseline.

Every run is `train.py`'s path in its own process (`build` + `trainer.fit`, the default suite on, one thread),
`--jobs` at a time, at the shape below on the embedded corpus (bytes). The target is the baseline's worst final
val loss over the seeds after `--steps`; each run reports the first evaluation at or below it (every `--eval-every` steps; the
evaluation's own time is not counted), its training wall and CPU time to there, its final val loss, and whether the
suite raised anything (an alarm, a forecast, a backoff: on a healthy run, a false one). A switch's ratios are per
seed against the baseline at the same seed; the table gives their median and range over the seeds. Steps are exact;
wall times move with a busy neighbour, CPU time less.

Usage: python benchmarks/speedrun_bench.py [--steps 300] [--seeds 3] [--jobs 2] [--only NAME,...] [--json F]
       [--quick] [overrides for every run...]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from time_to_loss import Clock, reach

from steadylm.config import compose
from steadylm.data.prepare import prepare
from steadylm.stability import read_events
from steadylm.train import build

# The baseline: steadylm's defaults with Muon at the shape below; each switch is added alone.
BASELINE = ["optim=muon", "optim.lr=2e-2", "trainer.precision=32-true"]
SHAPE = ["model.n_layer=4", "model.n_head=4", "model.d_model=128", "model.context_length=128", "data.batch_size=16"]
SWITCHES: dict[str, list[str]] = {
    "baseline": [],
    "bf16 autocast": ["trainer.precision=bf16-mixed"],
    "qk_norm": ["model.qk_norm=true"],
    "untied head": ["model.tie_embeddings=false"],
    "logit softcap 15": ["model.logit_softcap=15"],
    "doc-aligned windows": ["data.align=doc"],
    "experiment=fast": ["experiment=fast"],
}
QUICK = ["model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.context_length=32", "data.batch_size=4"]
NOISY = ("precursor", "attn_logit", "update_ratio", "loss_spike", "nonfinite_loss", "nonfinite_grad", "forecast")


def one_run(work: str, name: str, seed: int, args: dict) -> dict:
    """One fit in this process: its curve of (step, wall, cpu, val) and the suite's events."""
    torch.set_num_threads(1)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    out = Path(work) / f"{name.replace(' ', '_').replace('=', '-').replace(',', '')}-s{seed}"
    preset = name.startswith("experiment=")  # a preset brings its own optimizer and precision
    cfg = compose(
        [
            "trainer=cpu",
            f"data.dir={Path(work) / 'data'}",
            f"paths.output_dir={out}",
            "logger=none",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "trainer.num_sanity_val_steps=0",
            f"trainer.max_steps={args['steps']}",
            f"trainer.val_check_interval={args['eval_every']}",
            f"data.val_windows={args['val_batches'] * 16}",
            "~callbacks.checkpoint",
            *([] if preset else BASELINE),
            *args["shape"],
            *SWITCHES[name],
            f"seed={seed}",
            *args["overrides"],
        ]
    )
    objects = build(cfg)
    clock = Clock()
    objects["trainer"].callbacks.append(clock)
    objects["trainer"].fit(objects["module"], datamodule=objects["datamodule"])
    events = [e["kind"] for e in read_events(out) if e["kind"] in NOISY or e.get("action") in ("backoff", "rewind")]
    return {"name": name, "seed": seed, "curve": clock.curve, "events": sorted(set(events))}


def first_step(curve: list, target: float) -> int | None:
    hit = reach(curve, target)
    return hit[0] if hit else None


def report(results: list[dict], steps: int, at: float = 2 / 3) -> dict:
    """The table: per switch, the final val loss against the baseline's at the same seed, the steps the median curve
    over the seeds takes to the target (each seed's in brackets, '>N' never), the CPU time a step costs against the
    baseline's, their product (the time to the target), and the suite's events on these healthy runs."""
    by: dict[str, dict[int, dict]] = {}
    for r in results:
        by.setdefault(r["name"], {})[r["seed"]] = r
    seeds = sorted(by["baseline"])
    median_curve = lambda runs: [
        (p[0], statistics.median(r["curve"][i][3] for r in runs)) for i, p in enumerate(runs[0]["curve"])
    ]
    cost = lambda runs: statistics.median(r["curve"][-1][2] / r["curve"][-1][0] for r in runs)  # CPU s a step
    base = list(by["baseline"].values())
    # The target is reached mid-run, so a switch has room to get there sooner or later within the run.
    base_steps, target = min(median_curve(base), key=lambda p: abs(p[0] - at * steps))
    print(
        f"\ntarget: val loss {target:.4f}, the baseline's median over {len(seeds)} seeds at step {base_steps} of {steps}"
    )
    head = ("switch", "final val vs baseline", "steps to target (each seed)", "cpu/step", "time x", "suite events")
    print(f"{head[0]:22} {head[1]:<27} {head[2]:<30} {head[3]:>8} {head[4]:>7}  {head[5]}")
    table = {}
    for name, runs_by_seed in by.items():
        runs = [runs_by_seed[s] for s in seeds]
        delta = [100 * (runs_by_seed[s]["curve"][-1][3] / by["baseline"][s]["curve"][-1][3] - 1) for s in seeds]
        hit = next((step for step, val in median_curve(runs) if val <= target), None)
        each = [first_step(r["curve"], target) for r in runs]
        steps_x = hit / base_steps if hit else None
        cost_x = cost(runs) / cost(base)
        events = sorted({e for r in runs for e in r["events"]})
        table[name] = {"final_delta_pct": delta, "steps_x": steps_x, "each": each, "cpu_step_x": cost_x}
        table[name] |= {"time_x": steps_x * cost_x if hit else None, "events": events}
        d = f"{statistics.median(delta):+.1f} % [{min(delta):+.1f}, {max(delta):+.1f}]"
        st = f"{steps_x:.2f}x" if hit else f">{steps}"
        st += " (" + ", ".join(str(e) if e else f">{steps}" for e in each) + ")"
        tx = f"{steps_x * cost_x:.2f}x" if hit else "-"
        print(f"{name:22} {d:<27} {st:<30} {cost_x:7.2f}x {tx:>7}  {', '.join(events) or '-'}")
    return {"target": target, "table": table}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", type=lambda s: s.split(","), help="switch names to run (the baseline always runs)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes for the test suite; numbers are not meaningful")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--report", type=Path, help="print the table again from a --json file; runs nothing")
    a = ap.parse_args(argv)
    if a.report:
        saved = json.loads(a.report.read_text())
        return report(saved["runs"], saved["steps"])
    names = ["baseline", *(n for n in SWITCHES if n != "baseline" and (a.only is None or n in a.only))]
    if unknown := set(a.only or ()) - set(SWITCHES):
        ap.error(f"--only: unknown switch {sorted(unknown)[0]!r}; known: {', '.join(SWITCHES)}")
    shape = QUICK if a.quick else SHAPE
    if a.quick:
        a.steps, a.eval_every, a.val_batches, a.seeds = 20, 10, 2, 1
    work = tempfile.mkdtemp(prefix="steadylm-speedrun-")
    prepare(input=None, out_dir=Path(work) / "data", max_bytes=300_000 if a.quick else 3_000_000, progress=False)
    shared = {"shape": shape, "overrides": a.overrides, "steps": a.steps}
    shared |= {"eval_every": a.eval_every, "val_batches": a.val_batches}
    runs = [(n, s) for s in range(1, a.seeds + 1) for n in names]
    print(f"{len(runs)} runs of {a.steps} steps, {a.jobs} at a time, in {work}", file=sys.stderr)
    with ProcessPoolExecutor(a.jobs, max_tasks_per_child=1) as pool:
        results = list(pool.map(one_run, [work] * len(runs), *zip(*runs), [shared] * len(runs)))
    print(f"baseline: {' '.join(BASELINE + shape + a.overrides)}; {a.seeds} seeds; one thread a run")
    table = report(results, a.steps)
    if a.json:
        a.json.write_text(json.dumps({**table, "steps": a.steps, "runs": results}, indent=1))
    return table


if __name__ == "__main__":
    main()
