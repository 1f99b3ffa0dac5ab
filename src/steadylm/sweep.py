"""Sweep bookkeeping: each job's outcome in `<run_dir>/result.json`, and a summary of the whole sweep.

`finish_job` runs at the end of every job (rank 0 writes) and classifies it: a job *diverged* when its
loss went non-finite, a stability callback stopped it (a non-finite streak or a spike past the rollback
budget, or a final loss far above the run's best: see `stability.recovery`), or its `train()` raised; a job that
finished is *unstable* when its events show persisting logit growth or a mitigation acting materially
(`stability.instability`), and *ok* otherwise. `SweepSummary` is a
Hydra callback (`hydra.callbacks.sweep_summary`) that, when a multirun ends, writes
`<sweep_dir>/summary.md` (one row per job, then the best LR and, for a mup sweep, the command that trains
a bigger preset with it) and `summary.png` (final val loss vs LR, unstable and diverged jobs marked).
It only reads run dirs; it must never change a job's files.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from steadylm.distributed import is_rank_zero_process
from steadylm.stability.events import stop_event
from steadylm.stability.instability import instability

RESULT_FILE = "result.json"
# What a sweep's best LR means beyond its own shape: the parametrisation and muP's base shape.
TRANSFER_KEYS = ("parametrization", "mup_base_width", "mup_base_head_dim", "mup_output_mult", "d_model", "pos")


def divergence(metrics: dict[str, float], run_dir: Path, error: BaseException | None) -> str | None:
    """Why a job diverged, or None when it did not."""
    if error is not None:
        return f"train() raised {type(error).__name__}: {error}"
    event = stop_event(run_dir)
    if event is not None:
        detail = event.get("detail") or {}
        kind = detail.get("kind") if event.get("kind") == "stop" and detail.get("kind") else event.get("kind")
        module = detail.get("module")
        if module:  # a non-finite streak: the module says it all
            return f"stopped on {kind} at step {event.get('step')}, first in {module}"
        return f"stopped on {kind} at step {event.get('step')}" + (
            f": {detail['reason']}" if detail.get("reason") else ""
        )
    for key in ("train/loss", "val/loss"):
        if key in metrics and not math.isfinite(metrics[key]):
            return f"non-finite {key}"
    return None


def finish_job(
    cfg: DictConfig,
    metrics: dict[str, float],
    error: BaseException | None = None,
    preempted: dict[str, Any] | None = None,
) -> tuple[float | None, str, str | None]:
    """Record the job's outcome (rank 0); return the metric a sweeper optimises (NaN when diverged), the status
    (ok | unstable | diverged | preempted) and its reason. An unstable job keeps its metric: it finished, its
    loss is real. A job stopped by a signal (`preempted`: the record of `steadylm.preemption`) is `preempted`,
    with the step and the checkpoint `resume=auto` continues from."""
    run_dir = Path(cfg.paths.output_dir)
    reason = divergence(metrics, run_dir, error)
    status = "diverged" if reason else "ok"
    if preempted:
        status, reason = "preempted", f"{preempted['signal']} at step {preempted['step']}"
    elif not reason and (reason := instability(run_dir, float(cfg.optim.lr))):
        status = "unstable"
    if is_rank_zero_process():
        overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
        result = {
            "status": status,
            "reason": reason,
            **({"step": preempted["step"], "checkpoint": preempted["checkpoint"]} if preempted else {}),
            "lr": float(cfg.optim.lr),
            "val_loss": metrics.get("val/loss"),
            "train_loss": metrics.get("train/loss"),
            "overrides": overrides,
            "model": {
                **{k: cfg.model.get(k) for k in TRANSFER_KEYS},  # a null mup base is the model's own shape:
                "mup_base_width": cfg.model.get("mup_base_width") or cfg.model.d_model,
                "mup_base_head_dim": cfg.model.get("mup_base_head_dim") or cfg.model.d_model // cfg.model.n_head,
            },
        }
        run_dir.mkdir(parents=True, exist_ok=True)
        # json writes NaN/Infinity tokens, which json.loads reads back.
        (run_dir / RESULT_FILE).write_text(json.dumps(result, indent=2) + "\n")
    metric = cfg.get("optimized_metric")
    if not metric:
        return None, status, reason
    return (float("nan") if status == "diverged" else metrics.get(metric)), status, reason


def job_dirs(sweep_dir: Path) -> list[Path]:
    """Job folders of a sweep (those Hydra wrote a config into), in job order."""
    dirs = [p.parent.parent for p in sweep_dir.glob("*/.hydra/overrides.yaml")]
    return sorted(dirs, key=lambda p: (not p.name.isdigit(), int(p.name) if p.name.isdigit() else 0, p.name))


def read_job(job_dir: Path) -> dict[str, Any]:
    """A job's result; a job that never wrote one (killed, crashed hard) is `missing`."""
    path = job_dir / RESULT_FILE
    if path.is_file():
        return {"job": job_dir.name, **json.loads(path.read_text())}
    overrides = OmegaConf.load(job_dir / ".hydra" / "overrides.yaml")
    return {"job": job_dir.name, "status": "missing", "reason": f"no {RESULT_FILE}", "overrides": list(overrides)}


def _fmt(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


def summary_table(jobs: list[dict[str, Any]]) -> str:
    rows = [
        "| job | overrides | lr | final val/loss | status | reason |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for j in jobs:
        overrides = " ".join(f"`{o}`" for o in j.get("overrides", []))
        rows.append(
            f"| {j['job']} | {overrides} | {_fmt(j.get('lr'))} | {_fmt(j.get('val_loss'))} | "
            f"{j['status']} | {j.get('reason') or ''} |"
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


class SweepSummary(Callback):
    """Hydra callback: summarise the sweep once every job has finished."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        if sweep_dir.is_dir():
            jobs = summarize_sweep(sweep_dir)
            diverged = sum(j["status"] == "diverged" for j in jobs)
            unstable = sum(j["status"] == "unstable" for j in jobs)
            preempted = sum(j["status"] == "preempted" for j in jobs)
            print(
                f"sweep summary: {sweep_dir / 'summary.md'} ({len(jobs)} jobs, {unstable} unstable, {diverged} diverged"
                + (f", {preempted} preempted)" if preempted else ")")
            )
            print(best_lr(jobs), end="")
