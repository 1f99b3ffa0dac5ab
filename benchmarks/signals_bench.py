"""Precursor signals: hit rate against false alarms per signal level, and the mitigated runs.

Every run is a real `python train.py` of a small model on the embedded corpus (`--steps` steps, stats every
5 steps). Three groups:

- healthy: the grid that must raise nothing (two shapes, two seeds, adamw and muon, QK-norm on and off, muP);
- natural: too-high LR with and without QK-norm, no warmup, Muon at a high LR, a deep stack;
- injected: `lr_spike` faults (`stability/faults.py`) after the warmup.

Healthy, natural and injected runs observe only (`signals.action=log`, no QK-clip, spikes logged), so the loss
shows what the LR does. Per signal, its level is replayed over the logged values through `Precursors` itself:
a hit is an alarm in a natural or injected run, a false alarm one in a healthy run; the table gives the first
alarm and the step where the loss shows the trouble (`divergence_bench.loss_onset`): its 3-point running median
non-finite, or 10 % above both seeds of the same shape's healthy run (`TWIN`), since a too-high LR stalls the loss
more often than it spikes it; the deep run, which has no healthy twin, counts non-finite only. The mitigated group runs the default suite with QK-norm at the issue's LRs and compares its final
val loss with the stable LR's. The forecast, which reads its signals every step, is measured by
`benchmarks/divergence_bench.py`.

Usage: python benchmarks/signals_bench.py [--steps 150] [--jobs 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from steadylm.diagnose.runlog import load_run  # noqa: E402
from steadylm.stability import read_events  # noqa: E402
from steadylm.stability.signals import Precursors, signal_values  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from divergence_bench import loss_onset  # noqa: E402  (the loss's onset: one definition)

SMALL = ["model.d_model=64", "model.n_head=2", "model.context_length=64"]
WIDER = ["model.d_model=96", "model.n_head=4", "model.n_layer=4", "model.context_length=64"]
OBSERVE = [
    "callbacks.stability.signals.action=log",
    "callbacks.stability.qk_clip=null",
    "callbacks.stability.spike.action=log",
]
QK = "model.qk_norm=true"
NOQK = "model.qk_norm=false"

HEALTHY = {
    f"{shape} {opt} {qk} seed {seed}": [*dims, f"optim={opt}", f"model.qk_norm={qk == 'qk'}", f"seed={seed}"]
    for shape, dims in (("small", SMALL), ("wider", WIDER))
    for opt in ("adamw", "muon")
    for qk in ("qk", "noqk")
    for seed in (1, 2)
    if opt == "adamw" or (shape == "small" and seed == 1)
}
HEALTHY["small mup adamw qk seed 1"] = [*SMALL, QK, "model.parametrization=mup", "seed=1"]
NATURAL = {
    "QK-norm, lr 0.1": [*SMALL, QK, "optim.lr=0.1"],
    "QK-norm, lr 0.3": [*SMALL, QK, "optim.lr=0.3"],
    "no QK-norm, lr 0.1": [*SMALL, NOQK, "optim.lr=0.1"],
    "no warmup, lr 0.03": [*SMALL, NOQK, "optim.lr=0.03", "optim.warmup_steps=0"],
    "Muon, lr 0.1": [*SMALL, QK, "optim=muon", "optim.lr=0.1"],
    "deep (12 layers), lr 0.03": [*SMALL, NOQK, "model.n_layer=12", "optim.lr=0.03"],
}
INJECTED = {
    f"lr_spike x{factor} at step 80": [
        *SMALL,
        QK,
        f"+callbacks.faults={{_target_: steadylm.stability.faults.FaultInjector, faults: [{{kind: lr_spike, step: 80, "
        f"factor: {factor}}}]}}",
    ]
    for factor in (100, 1000)
}
# The healthy run each natural run's loss is compared with (same shape, default LR): a too-high LR seldom spikes
# the loss, it stalls it, and the stall shows only against a run that goes on learning.
TWIN = {
    "QK-norm, lr 0.1": "small adamw qk seed 1",
    "QK-norm, lr 0.3": "small adamw qk seed 1",
    "no QK-norm, lr 0.1": "small adamw noqk seed 1",
    "no warmup, lr 0.03": "small adamw noqk seed 1",
    "Muon, lr 0.1": "small muon qk seed 1",
    **{name: "small adamw qk seed 1" for name in INJECTED},
}
MITIGATED = {f"QK-norm, lr {lr}": [*SMALL, QK, f"optim.lr={lr}", "seed=5"] for lr in ("3e-3", "0.1", "0.3")}

# The levels compared: each signal judged alone. The defaults are the first of each.
DEFAULT = "residual_rms>100"  # the default alarm, that a forecast runs ahead of
LEVELS = {"residual_rms": (100.0, 30.0), "update_ratio": (0.03, 0.1), "log_z": (10.0,), "attn_logit": (100.0,)}


def run(out: Path, overrides: list[str], steps: int) -> Path:
    base = [
        f"hydra.run.dir={out}",
        f"trainer.max_steps={steps}",
        f"optim.warmup_steps={steps // 5}",
        "trainer.log_every_n_steps=5",
        f"trainer.val_check_interval={steps}",
        "data.val_windows=128",
        "trainer.enable_progress_bar=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STEADYLM_ROOT": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "train.py"), *base, *overrides]  # later overrides win (warmup 0)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if not (out / "result.json").exists():
        raise SystemExit(f"error: {' '.join(cmd)} wrote no result.json:\n{proc.stderr[-2000:]}")
    return out


def warmup_of(overrides: list[str], steps: int) -> int:
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("optim.warmup_steps=")]
    return int(given[-1]) if given else steps // 5


def values_by_step(run_dir: Path) -> dict[int, dict[str, float]]:
    """Each stats step's signal values, as the run's `Stability` saw them."""
    log = load_run(run_dir)
    qk_norm = bool(log.setting("model.qk_norm", False))
    by_step: dict[int, dict[str, float]] = {}
    for tag, (steps, values) in log.scalars.items():
        if tag.startswith("stability/"):
            for s, v in zip(steps, values):
                by_step.setdefault(int(s), {})[tag] = float(v)
    return {s: signal_values(m, qk_norm) for s, m in sorted(by_step.items()) if "stability/update_ratio" in m}


def replay(series: dict[int, dict[str, float]], signal: str, level: float, warmup: int) -> int | None:
    """The first step `Precursors` alarms on with only `signal` judged at `level` (None: never)."""
    levels = {s: None for s in LEVELS}
    check = Precursors(**{**levels, signal: level}, action="log")
    for step, values in series.items():
        for v in check.observe(step, values, in_warmup=step < warmup):
            if v.kind == "precursor" or (signal == "attn_logit" and values.get("attn_logit", 0) > level):
                return step
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--reuse", type=Path, help="analyse the runs already in this folder (a previous run's work dir)")
    args = ap.parse_args()
    work = args.reuse or Path(tempfile.mkdtemp(prefix="steadylm-signals-"))
    groups = {"healthy": HEALTHY, "natural": NATURAL, "injected": INJECTED}
    jobs = [(g, name, [*o, *OBSERVE]) for g, cases in groups.items() for name, o in cases.items()]
    jobs += [("mitigated", name, o) for name, o in MITIGATED.items()]
    with ThreadPoolExecutor(args.jobs) as pool:
        futures = {
            (g, name): (o, pool.submit(lambda d, o: d if args.reuse else run(d, o, args.steps), work / f"{g}-{i}", o))
            for i, (g, name, o) in enumerate(jobs)
        }
    print(f"runs in {work}")
    seeds = {t: [t, t.replace("seed 1", "seed 2")] for t in TWIN.values()}  # muon's shape has one seed
    twins = {
        n: [futures[("healthy", s)][1].result() for s in seeds[t] if ("healthy", s) in futures] for n, t in TWIN.items()
    }
    rows = {}
    for (g, name), (o, fut) in futures.items():
        d = fut.result()
        series = values_by_step(d)
        events = read_events(d)
        result = json.loads((d / "result.json").read_text())
        rows[(g, name)] = {
            "alarms": {
                f"{s}>{lv:g}": replay(series, s, lv, warmup_of(o, args.steps))
                for s, lvs in LEVELS.items()
                for lv in lvs
            },
            "onset": loss_onset(d, twins.get(name, [])),
            "status": result["status"],
            "val_loss": result.get("val_loss"),
            "events": sorted({e["kind"] for e in events}),
        }
    report(rows)
    if args.json:
        args.json.write_text(json.dumps({f"{g}: {n}": r for (g, n), r in rows.items()}, indent=1))


def report(rows: dict) -> None:
    names = list(next(iter(rows.values()))["alarms"])
    bad = [r for (g, _), r in rows.items() if g in ("natural", "injected")]
    good = [r for (g, _), r in rows.items() if g == "healthy"]
    print(f"\n## Hit rate against false alarms ({len(bad)} unstable runs, {len(good)} healthy runs)\n")
    print("| signal > level | hits | false alarms |\n| --- | --- | --- |")
    for n in names:
        hits = sum(r["alarms"][n] is not None for r in bad)
        false = sum(r["alarms"][n] is not None for r in good)
        print(f"| {n} | {hits}/{len(bad)} | {false}/{len(good)} |")
    print("\n## Per run (observe only)\n")
    print("| group | run | first alarm per signal | loss shows it | alarm lead on loss |")
    print("| --- | --- | --- | --- | --- |")
    leads = []
    for (g, name), r in rows.items():
        if g == "mitigated":
            continue
        alarms = ", ".join(f"{k}@{v}" for k, v in r["alarms"].items() if v is not None) or "-"
        alarm, lead = r["alarms"][DEFAULT], "-"
        if alarm is not None and r["onset"] is not None:
            lead = r["onset"] - alarm
            leads.append(lead)
        onset = r["onset"] if r["onset"] is not None else "-"
        print(f"| {g} | {name} | {alarms} | {onset} | {lead} |")
    if leads:
        print(f"\nthe default alarm ahead of the loss, steps: median {statistics.median(leads):g}, worst {min(leads)}")
    print(
        "\n## Mitigated (default suite)\n\n| run | status | val loss | vs stable | events |\n| --- | --- | --- | --- | --- |"
    )
    mitigated = {n: r for (g, n), r in rows.items() if g == "mitigated"}
    stable = mitigated["QK-norm, lr 3e-3"]["val_loss"]
    for n, r in mitigated.items():
        gap = f"{r['val_loss'] / stable - 1:+.1%}" if r["val_loss"] and stable else "-"
        print(f"| {n} | {r['status']} | {r['val_loss']:.3f} | {gap} | {', '.join(r['events']) or 'none'} |")


if __name__ == "__main__":
    main()
