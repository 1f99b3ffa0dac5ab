"""The divergence benchmark: natural instabilities, their healthy twins, and what the forecast and the suite made of
them (precision, recall and lead time of the `forecast` events; whether the default suite mitigated the run).

Every run is a real `python train.py` of tiny's 2 layers at d 64 and context 64 (deeper where a scenario says) on
the embedded corpus. Each scenario runs twice: observed (`callbacks.stability.signals.action=log`, QK-clip
measuring but never clipping, spikes logged) for the lead times, and with the default suite for the mitigation.
Its healthy twin (the scenario's fix, e.g. the default LR) runs at three seeds; the healthy group adds the twins at
2x their LR and the tiny and fast presets at their defaults and at 2x. Judged per run:

- forecast: the first `forecast` event; how many steps before the first alarm and the loss's onset it came;
- the first alarm: the first `precursor`, `attn_logit`, `update_ratio`, `loss_spike` or non-finite event;
- the loss's onset: its 3-point running median non-finite, or 10 % above each of the twin's seeds' at the same step;
- mitigated: with the default suite, the final val loss within 10 % of the twin's, or an end other than `ok`;
- false forecasts: any forecast on a healthy run, and a forecast on an unstable run whose horizon (`by_step`)
  passed with neither an alarm nor the loss's onset.

With `--act F` each scenario also runs with `callbacks.stability.signals.forecast_lr=F` (the forecast lowers the
LR until its horizon passes) and with `forecast_lr=null` (only the alarm acts), compared by the final val loss.

Usage: python benchmarks/divergence_bench.py [--steps 200] [--jobs 2] [--json out.json] [--only NAME ...]
       [--reuse DIR] [--act F] [--device cpu|cuda] [overrides for every run...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from steadylm.data.prepare import prepare, stdlib_files  # noqa: E402
from steadylm.diagnose.runlog import load_run  # noqa: E402
from steadylm.stability import read_events  # noqa: E402

SHAPE = ["model.d_model=64", "model.n_head=2", "model.context_length=64"]
QK, NOQK = ["model.qk_norm=true"], ["model.qk_norm=false"]
OBSERVE = [
    "callbacks.stability.signals.action=log",
    "callbacks.stability.qk_clip.tau=1e9",  # measures the logits every step, never clips
    "callbacks.stability.spike.action=log",
]
ALARMS = ("precursor", "attn_logit", "update_ratio", "loss_spike", "nonfinite_loss", "nonfinite_grad")

# name: (source, the unstable run's overrides, its healthy twin's). The twin is the fix: the same model, trained
# as the defaults would.
TWINS = {
    "noqk": NOQK,
    "qk": QK,
    "deep8": [*NOQK, "model.n_layer=8"],
    "deep12": [*NOQK, "model.n_layer=12"],
    "muon_qk": [*QK, "optim=muon"],
    "muon_noqk": [*NOQK, "optim=muon"],
    "init1": [*NOQK, "model.init=torch_default", "model.parametrization=sp", "model.tie_embeddings=false"],
    "untied": [*QK, "model.tie_embeddings=false"],
    # in order, so the repeated stretch arrives as a window of steps; {work}: the bench's folder (`data_folders`)
    "clean_data": [*NOQK, "data.dir={work}/data-clean", "data.shuffle=false"],
    "fp16": [*NOQK, "trainer=gpu", "trainer.precision=16-mixed"],
    "fast": ["experiment=fast"],  # Muon, bf16 where the CPU has bf16 units
    # a second stage from a trained run's weights (`{work}/pretrained`, run first): a new schedule, its own warmup
    "restart": [*NOQK, "init_from={work}/pretrained/checkpoints/last.ckpt"],
}
NEEDS_CUDA = {"fp16"}  # Lightning runs 16-mixed on a CPU as bf16-mixed, so fp16's overflow needs a CUDA GPU
REPEATED = ("this.py", 40)  # the real stdlib file repeated, and how often (~33 KB: ~32 steps of 16 x 64 bytes)
REPEAT_AT = 60 * 1024  # where the repeated stretch starts in the training bytes: near step 60
SCENARIOS = {
    "lr 10x, no QK-norm": ("Wortsman et al. 2023: attention-logit growth", [*NOQK, "optim.lr=0.02"], "noqk"),
    "lr 30x, no QK-norm": ("Wortsman et al. 2023: attention-logit growth", [*NOQK, "optim.lr=0.06"], "noqk"),
    "lr 30x, QK-norm": ("Wortsman et al. 2023: output-logit divergence", [*QK, "optim.lr=0.06"], "qk"),
    "lr 100x, QK-norm": ("Wortsman et al. 2023: residual and output-logit growth", [*QK, "optim.lr=0.2"], "qk"),
    "no warmup, no clipping, 8 layers": (
        "the seed guide: no warmup on a deep stack",
        [*TWINS["deep8"], "optim.lr=0.02", "optim.warmup_steps=0", "trainer.gradient_clip_val=0"],
        "deep8",
    ),
    "12 layers, lr 10x": (
        "the seed guide: unstable init in deep stacks",
        [*TWINS["deep12"], "optim.lr=0.02"],
        "deep12",
    ),
    "Muon lr 10x, QK-norm": ("Muon at a too-high LR", [*TWINS["muon_qk"], "optim.lr=0.2"], "muon_qk"),
    "Muon lr 10x, no QK-norm": ("Muon at a too-high LR", [*TWINS["muon_noqk"], "optim.lr=0.2"], "muon_noqk"),
    "Adam eps 1e-12, beta2 0.9999, lr 10x": (
        "Molybog et al. 2023: the update-time-scale instability",
        [*NOQK, "optim.eps=1e-12", "optim.betas=[0.9,0.9999]", "optim.lr=0.02"],
        "noqk",
    ),
    "embeddings N(0, 1), untied head, lr 10x": (
        "Takase et al. 2023 (Spike No More): the embedding scale",
        [*TWINS["init1"], "optim.lr=0.02"],
        "init1",
    ),
    "untied head, lr 30x, QK-norm": (
        "Wortsman et al. 2023: output-logit divergence (z-loss its fix)",
        [*TWINS["untied"], "optim.lr=0.06"],
        "untied",
    ),
    "weight decay 0, lr 30x, QK-norm": (
        "the seed guide: no weight decay at a high LR",
        [*QK, "optim.weight_decay=0", "optim.lr=0.06"],
        "qk",
    ),
    "one stdlib file repeated 40x in the data, in order": (
        "Chowdhery et al. 2022 (PaLM): spikes tied to particular data batches",
        [*NOQK, "data.dir={work}/data-repeated", "data.shuffle=false"],
        "clean_data",
    ),
    "LR restarted at 10x with no warmup, from trained weights": (
        "the seed guide: an abrupt LR jump (a schedule restarted high mid-run)",
        [*TWINS["restart"], "optim.lr=0.02", "optim.warmup_steps=0"],
        "restart",
    ),
    "experiment=fast, lr 3x": ("the fast preset (Muon) at 3x its LR", [*TWINS["fast"], "optim.lr=0.06"], "fast"),
    "fp16 mixed precision, lr 30x, no QK-norm": (
        "Micikevicius et al. 2018: fp16's range (65504) against growing activations, the loss scale its guard",
        [*TWINS["fp16"], "optim.lr=0.06"],
        "fp16",
    ),
}
SEEDS = (1, 2, 3)
DOUBLED = {"noqk": "optim.lr=4e-3", "qk": "optim.lr=4e-3", "muon_qk": "optim.lr=4e-2", "muon_noqk": "optim.lr=4e-2"}
DOUBLED["fast"] = "optim.lr=4e-2"
# at their defaults and at 2x their LR, tiny's shape (not SHAPE); Muon's residual grows with the LR and the depth
PRESETS = {"tiny": ([], (1, 2)), "fast": (["experiment=fast"], SEEDS), "tiny 2x": (["optim.lr=4e-3"], (1,))}
PRESETS["fast 2x"] = (["experiment=fast", "optim.lr=4e-2"], SEEDS)
PRESETS["fast 2x, 8 layers"] = (["experiment=fast", "optim.lr=4e-2", "model.n_layer=8"], (1,))


def data_folders(work: Path) -> None:
    """`work/data-repeated`: the first ~300 KB of the embedded corpus's real stdlib files with one of them
    (`REPEATED`) repeated where training reaches `REPEAT_AT`; `work/data-clean`: the same without the repeats.
    Made with `prepare` (bytes), as `python -m steadylm.data.prepare data.input=<folder>` would."""
    name, times = REPEATED
    files, texts, size = stdlib_files(), [], 0
    for f in files:
        texts.append(f.read_text(errors="replace"))
        size += len(texts[-1])
        if size > 300_000:
            break
    at = next(i for i in range(len(texts)) if sum(map(len, texts[: i + 1])) >= REPEAT_AT) + 1
    repeat = next(f for f in files if f.name == name).read_text() * times
    for kind, pieces in (("repeated", [*texts[:at], repeat, *texts[at:]]), ("clean", texts)):
        src, out = work / f"text-{kind}", work / f"data-{kind}"
        if (out / "tokenizer.json").exists():
            continue
        src.mkdir(parents=True, exist_ok=True)
        for i, text in enumerate(pieces):  # the folder's sorted names keep this order
            (src / f"{i:04d}.txt").write_text(text)
        n_tokens = sum(len(t.encode()) + 1 for t in pieces)  # a byte a token, and each document's end
        # the same val for both, the last 2048 tokens (one slice, at the stream's end): the val losses compare
        prepare(input=str(src), out_dir=out, val_fraction=2048 / n_tokens, num_proc=1, progress=False)


def run(out: Path, overrides: list[str], steps: int, extra: list[str]) -> Path:
    if (out / "result.json").exists():
        return out
    base = [
        f"hydra.run.dir={out}",
        f"trainer.max_steps={steps}",
        f"optim.warmup_steps={steps // 10}",
        "trainer.log_every_n_steps=5",
        f"trainer.val_check_interval={steps}",
        "data.val_windows=128",
        "trainer.enable_progress_bar=false",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "train.py"), *base, *overrides, *extra]  # later overrides win (warmup 0)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if not (out / "result.json").exists():
        raise SystemExit(f"error: {' '.join(cmd)} wrote no result.json:\n{proc.stderr[-2000:]}")
    return out


def running_median(run_dir: Path) -> dict[int, float]:
    """The 3-point running median of the training loss by step; inf from a non-finite loss on."""
    steps, loss = load_run(run_dir).series("train/loss")
    out, bad = {}, False
    for i in range(len(steps)):
        bad = bad or not math.isfinite(loss[i])
        out[int(steps[i])] = math.inf if bad else statistics.median(loss[max(0, i - 2) : i + 1])
    return out


def loss_onset(run_dir: Path, twins: list[Path]) -> int | None:
    """Where the loss shows the trouble: non-finite, or 10 % above all its twin's seeds at the same step. Not "above
    one seed": in the first descent the healthy seeds differ by 15 % (Muon's at step 14); not "above its own best":
    a healthy run whose data come in order has harder stretches (the repeated-data twin rises 17 % at step 49)."""
    med = running_median(run_dir)
    refs = [running_median(t) for t in twins]
    for i, (step, m) in enumerate(med.items()):
        ref = max((r[step] for r in refs if step in r), default=math.inf)
        if not math.isfinite(m) or (i >= 2 and m > ref * 1.10):
            return step
    return None


def judge(run_dir: Path, twins: list[Path] | None) -> dict:
    events = read_events(run_dir) if (run_dir / "stability").exists() else []
    forecasts = [e for e in events if e["kind"] == "forecast"]
    alarms = [e["step"] for e in events if e["kind"] in ALARMS]
    result = json.loads((run_dir / "result.json").read_text())
    onset = loss_onset(run_dir, twins) if twins else None
    first = forecasts[0] if forecasts else None
    came = [s for s in (*alarms, onset) if s is not None]
    false = [f for f in forecasts if not any(f["step"] <= s <= f["detail"].get("by_step", math.inf) for s in came)]
    return {
        "forecast": first["step"] if first else None,
        "signal": first["detail"]["signal"] if first else None,
        "alarm": min(alarms) if alarms else None,
        "onset": onset,
        "false": len(false),
        "forecasts": len(forecasts),
        "status": result["status"],
        "val_loss": result.get("val_loss"),
    }


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only", action="append", help="a scenario's name (repeatable; their twins run too)")
    ap.add_argument("--reuse", type=Path, help="a previous work folder: runs already there are not run again")
    ap.add_argument("--act", type=float, help="also run each scenario with signals.forecast_lr=ACT and =null; compare")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: also the fp16 scenario")
    ap.add_argument("overrides", nargs="*")
    return ap.parse_args(argv)


def chosen(args: argparse.Namespace) -> dict:
    """The scenarios `args` runs: `--only`'s (a name that is none is an error), less those this device cannot."""
    if unknown := sorted(set(args.only or ()) - set(SCENARIOS)):
        sys.exit(f"error: --only {unknown[0]!r} is no scenario; one of: {', '.join(SCENARIOS)}")
    scenarios = {n: s for n, s in SCENARIOS.items() if not args.only or n in args.only}
    for name in [n for n, (_, _, t) in scenarios.items() if t in NEEDS_CUDA and args.device != "cuda"]:
        print(f"skipped: {name} needs a CUDA GPU (--device cuda); on a CPU Lightning runs 16-mixed as bf16-mixed")
        del scenarios[name]
    return scenarios


def main() -> None:
    args = arguments()
    scenarios = chosen(args)
    twins = sorted({t for _, _, t in scenarios.values()})
    if not (ROOT / "data/stdlib-bytes/tokenizer.json").exists():  # a fresh clone: the default data, as `make data`
        subprocess.run([sys.executable, "-m", "steadylm.data.prepare"], cwd=ROOT, check=True)
    work = (args.reuse or Path(tempfile.mkdtemp(prefix="steadylm-divergence-"))).resolve()
    if "clean_data" in twins:
        data_folders(work)
    if "restart" in twins:  # the run whose weights the restarted schedules start from, before them
        run(work / "pretrained", [*SHAPE, *NOQK, "seed=1"], args.steps, args.overrides)
    jobs = {}
    for t in twins:
        for seed in SEEDS:
            jobs[("twin", t, seed)] = [*SHAPE, *TWINS[t], f"seed={seed}"]
        if t in DOUBLED:
            jobs[("2x lr", t, 1)] = [*SHAPE, *TWINS[t], DOUBLED[t], "seed=1"]
    for p, (overrides, seeds) in PRESETS.items():
        if not args.only or p.split()[0] in twins:  # a preset whose scenario runs is judged at its defaults too
            jobs.update({("preset", p, seed): [*overrides, f"seed={seed}"] for seed in seeds})
    for name, (_, o, _) in scenarios.items():
        jobs[("observed", name, 1)] = [*SHAPE, *o, *OBSERVE, "seed=1"]
        jobs[("default suite", name, 1)] = [*SHAPE, *o, "seed=1"]
        if args.act:
            for group, factor in (("forecast acts", args.act), ("alarm only", "null")):
                jobs[(group, name, 1)] = [*SHAPE, *o, f"callbacks.stability.signals.forecast_lr={factor}", "seed=1"]
    jobs = {k: [o.replace("{work}", str(work)) for o in overrides] for k, overrides in jobs.items()}
    folder = {key: work / slug(key) for key in jobs}
    print(f"{len(jobs)} runs in {work}", flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        done = {k: pool.submit(run, folder[k], o, args.steps, args.overrides) for k, o in jobs.items()}
        for f in done.values():
            f.result()
    twin_seeds = {n: [folder[("twin", t, seed)] for seed in SEEDS] for n, (_, _, t) in scenarios.items()}
    # the 2x runs are healthy and have twins: the onset rule judged on them is its own false-onset check
    twin_seeds.update({t: [folder[("twin", t, seed)] for seed in SEEDS] for t in twins})
    rows = {k: judge(folder[k], twin_seeds.get(k[1]) if k[0] not in ("twin", "preset") else None) for k in jobs}
    report(scenarios, rows, folder)
    if args.act:
        compare(scenarios, rows, args.act)
    if args.json:
        args.json.write_text(json.dumps({" | ".join(map(str, k)): r for k, r in rows.items()}, indent=1))


def gap(row: dict, twin: dict) -> float:
    """The final val loss over the twin's, less 1 (inf when either has none)."""
    return row["val_loss"] / twin["val_loss"] - 1 if row["val_loss"] and twin["val_loss"] else math.inf


def compare(scenarios: dict, rows: dict, act: float) -> None:
    """Acting on the forecast (`forecast_lr`) against acting on the alarm only, by the unstable runs' final val."""
    print(f"\n| scenario | alarm only: val vs twin | forecast acts (forecast_lr={act:g}) | better |")
    print("| --- | --- | --- | --- |")
    alarm, acted = [], []
    for name, (_, _, twin) in scenarios.items():
        t = rows[("twin", twin, 1)]
        a, f = gap(rows[("alarm only", name, 1)], t), gap(rows[("forecast acts", name, 1)], t)
        alarm.append(a)
        acted.append(f)
        better = "forecast" if f < a - 0.005 else "alarm" if a < f - 0.005 else "level"
        print(f"| {name} | {a:+.1%} | {f:+.1%} | {better} |")
    wins = sum(f < a - 0.005 for a, f in zip(alarm, acted))
    losses = sum(a < f - 0.005 for a, f in zip(alarm, acted))
    print(
        f"val vs twin, median and mean: alarm only {statistics.median(alarm):+.1%}, {statistics.mean(alarm):+.1%};"
        f" forecast acts {statistics.median(acted):+.1%}, {statistics.mean(acted):+.1%}; forecast better on {wins},"
        f" worse on {losses} of {len(alarm)} (0.5 % either way is level)"
    )


def slug(key: tuple) -> str:
    """A run's folder name: its group, case and seed, in file-name characters."""
    return "-".join("".join(c if c.isalnum() else "_" for c in str(part)) for part in key)


def _s(v) -> str:
    return "-" if v is None else str(v)


def report(scenarios: dict, rows: dict, folder: dict) -> None:
    columns = ("forecast (signal)", "first alarm", "lead on alarm", "loss onset", "lead on onset", "default suite")
    print("\n| scenario (source) | " + " | ".join(columns) + " |\n" + "| --- " * (len(columns) + 1) + "|")
    leads, alarm_leads, hits, onsets, false_unstable, mitigated = [], [], 0, 0, 0, 0
    for name, (source, _, twin) in scenarios.items():
        r, d, t = rows[("observed", name, 1)], rows[("default suite", name, 1)], rows[("twin", twin, 1)]
        lead = ahead = None
        if r["forecast"] is not None and r["alarm"] is not None and r["forecast"] <= r["alarm"]:
            ahead = r["alarm"] - r["forecast"]
            alarm_leads.append(ahead)
        if r["onset"] is not None:
            onsets += 1
            if r["forecast"] is not None and r["forecast"] < r["onset"]:
                hits, lead = hits + 1, r["onset"] - r["forecast"]
                leads.append(lead)
        false_unstable += r["false"]
        gap = (d["val_loss"] / t["val_loss"] - 1) if d["val_loss"] and t["val_loss"] else math.inf
        ok = d["status"] != "ok" or gap <= 0.10
        mitigated += ok
        fc = f"{r['forecast']} ({r['signal']})" if r["forecast"] is not None else "-"
        suite = f"{d['status']}, val {gap:+.1%} vs twin" + ("" if ok else " (NOT mitigated)")
        cells = (fc, _s(r["alarm"]), _s(ahead), _s(r["onset"]), _s(lead), suite)
        print(f"| {name} ({source}) | " + " | ".join(cells) + " |")
    healthy = {k: r for k, r in rows.items() if k[0] in ("twin", "2x lr", "preset")}
    false_healthy = [f"{k[0]} {k[1]} seed {k[2]}" for k, r in healthy.items() if r["forecasts"]]
    print(f"\nrecall: {hits}/{onsets} unstable runs whose loss turned were forecast before the onset")
    if leads:
        print(f"lead over the onset: median {statistics.median(leads)} steps (min {min(leads)}, max {max(leads)})")
    if alarm_leads:
        a = alarm_leads
        print(
            f"lead over the first alarm: median {statistics.median(a)} steps (min {min(a)}, max {max(a)}), {len(a)} runs"
        )
    print(f"false forecasts: {len(false_healthy)} of {len(healthy)} healthy runs", end="")
    print(f" ({', '.join(false_healthy)})" if false_healthy else "", end="")
    print(f"; {false_unstable} on unstable runs whose horizon passed with nothing")
    print(f"mitigated by the default suite: {mitigated}/{len(scenarios)}")
    alarmed = [f"{k[0]} {k[1]} seed {k[2]}" for k, r in healthy.items() if r["alarm"] is not None]
    print(f"alarms on healthy runs: {len(alarmed)} of {len(healthy)}" + (f" ({', '.join(alarmed)})" if alarmed else ""))
    turned = [f"{k[0]} {k[1]} at {r['onset']}" for k, r in healthy.items() if r["onset"] is not None]
    n_twinned = sum(k[0] == "2x lr" for k in healthy)
    print(f"loss onsets on healthy runs (the 2x runs against their twins): {len(turned)} of {n_twinned}", end="")
    print(f" ({', '.join(turned)})" if turned else "")
    bad = [k for k, r in healthy.items() if r["status"] != "ok"]
    if bad:
        print("healthy runs not ok: " + ", ".join(f"{k} ({rows[k]['status']}, {folder[k]})" for k in bad))


if __name__ == "__main__":
    main()
