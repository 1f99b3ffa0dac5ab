"""The summary of a sweep: when a multirun ends, `hydra_callbacks.SweepSummary` (a Hydra callback) has `report` write
`<sweep_dir>/summary.md` (one row per job from its `result.json`, see `result.py`, then the best LR and, for a
mup sweep, the command that trains a bigger preset with it) and `summary.png` (final val loss vs LR, unstable
and diverged jobs marked). It only reads run dirs; it must never change a job's files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from steadylm.result import RESULT_FILE


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Job folders of a sweep (those Hydra wrote a config into), in job order."""
    dirs = [p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")]
    return sorted(dirs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def read_job(job_dir: Path) -> dict[str, Any]:
    """A job's result (`failed`: its reason is the first failing rank's own error); a job that never wrote one (its
    process killed) is `missing`."""
    path = job_dir / RESULT_FILE
    if path.is_file():
        return {"job": job_dir.name, **json.loads(path.read_text())}
    overrides = OmegaConf.load(job_dir / ".hydra" / "overrides.yaml")
    return {"job": job_dir.name, "status": "missing", "reason": f"no {RESULT_FILE}", "overrides": list(overrides)}


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def summary_table(jobs: list[dict[str, Any]]) -> str:
    """One row a job; with `data.sources`, a column of each source's final val/loss."""
    mixed = any(j.get("val_loss_by_source") for j in jobs)
    extra = (" by source |", " --- |") if mixed else ("", "")
    rows = [
        f"| job | overrides | lr | final val/loss |{extra[0]} status | reason |",
        f"| --- | --- | --- | --- |{extra[1]} --- | --- |",
    ]
    for j in jobs:
        overrides = " ".join(f"`{o}`" for o in j.get("overrides", []))
        by = ", ".join(f"{n} {_fmt(v)}" for n, v in (j.get("val_loss_by_source") or {}).items())
        rows.append(
            f"| {j['job']} | {overrides} | {_fmt(j.get('lr'))} | {_fmt(j.get('val_loss'))} |"
            + (f" {by} |" if mixed else "")
            + f" {j['status']} | {j.get('reason') or ''} |"
        )
    return "\n".join(rows) + "\n"


def best_lr(jobs: list[dict[str, Any]]) -> str:
    """The best finished job's LR and, under mup, the command that trains the bigger preset with it."""
    done = [j for j in jobs if j["status"] == "ok" and j.get("val_loss") is not None and math.isfinite(j["val_loss"])]
    if not done:
        return "No job finished with a finite val/loss: no best LR.\n"
    best = min(done, key=lambda j: j["val_loss"])
    m = best.get("model") or {}
    head = f"**Best LR: {best['lr']:g}** (job {best['job']}, val/loss {best['val_loss']:.4g})."
    if m.get("parametrization") != "mup":
        return (
            f"{head} Under sp it holds at this width only (the optimum shrinks about an octave per doubling); "
            "sweep with `model.parametrization=mup` to carry it to a wider preset.\n"
        )
    preset = "llama_small" if m.get("pos") == "rope" else "small"
    command = (
        f"python train.py model={preset} model.parametrization=mup model.mup_base_width={m['mup_base_width']} "
        f"model.mup_base_head_dim={m['mup_base_head_dim']}"
        + (f" model.mup_output_mult={m['mup_output_mult']:g}" if m.get("mup_output_mult", 1.0) != 1.0 else "")
        + f" optim.lr={best['lr']:g}"
    )
    return (
        f"{head} Under mup it holds at any width with the same base shape "
        f"({m['mup_base_width']} wide, head size {m['mup_base_head_dim']}); train the bigger preset with it "
        f"(plus your data and trainer overrides):\n\n    {command}\n"
    )


def plot_summary(jobs: list[dict[str, Any]], path: Path) -> None:
    """Final val loss vs LR; diverged jobs drawn as red crosses along the top edge, not left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = sorted(
        (j["lr"], j["val_loss"])
        for j in jobs
        if j["status"] == "ok" and j.get("val_loss") is not None and math.isfinite(j["val_loss"])
    )
    unstable = [(j["lr"], j["val_loss"]) for j in jobs if j["status"] == "unstable" and j.get("val_loss") is not None]
    diverged = [j["lr"] for j in jobs if j["status"] == "diverged" and j.get("lr") is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    if ok:
        ax.plot(*zip(*ok), "o-", color="tab:blue", label="final val/loss")
    if unstable:
        ax.plot(*zip(*unstable), "s", color="tab:orange", markersize=9, label="unstable (mitigated)")
    top = max((loss for _, loss in ok + unstable if math.isfinite(loss)), default=1.0) * 1.1
    if diverged:
        ax.plot(diverged, [top] * len(diverged), "x", color="tab:red", markersize=12, mew=3, label="diverged")
        for lr in diverged:
            ax.annotate(
                "diverged", (lr, top), textcoords="offset points", xytext=(0, -16), ha="center", color="tab:red"
            )
        ax.set_ylim(top=top * 1.05)
    lrs = [lr for lr, _ in ok + unstable] + diverged
    if lrs and min(lrs) > 0 and len(set(lrs)) > 1:
        ax.set_xscale("log")
    ax.set_xlabel("optim.lr")
    ax.set_ylabel("final val/loss")
    ax.set_title(f"sweep: {len(jobs)} jobs, {len(unstable)} unstable, {len(diverged)} diverged")
    if ok or unstable or diverged:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summarize_sweep(sweep_dir: Path) -> list[dict[str, Any]]:
    """Write `summary.md` and `summary.png` into `sweep_dir`; returns the job records."""
    jobs = [read_job(d) for d in job_dirs(sweep_dir)]
    text = f"# Sweep summary: {sweep_dir}\n\n{summary_table(jobs)}\n{best_lr(jobs)}"
    (sweep_dir / "summary.md").write_text(text)
    plot_summary(jobs, sweep_dir / "summary.png")
    return jobs


def report(sweep_dir: Path) -> None:
    """`SweepSummary`'s work when a multirun ends: the summary files, and what they say in two lines."""
    if sweep_dir.is_dir():
        jobs = summarize_sweep(sweep_dir)
        diverged = sum(j["status"] == "diverged" for j in jobs)
        unstable = sum(j["status"] == "unstable" for j in jobs)
        failed = sum(j["status"] == "failed" for j in jobs)
        preempted = sum(j["status"] == "preempted" for j in jobs)
        print(
            f"sweep summary: {sweep_dir / 'summary.md'} ({len(jobs)} jobs, {unstable} unstable, {diverged} diverged"
            + (f", {failed} failed" if failed else "")
            + (f", {preempted} preempted)" if preempted else ")")
        )
        print(best_lr(jobs), end="")
