"""Write `RUN_DIR/report.md` and its PNG plots from a loaded run and its diagnosis."""

from __future__ import annotations

from pathlib import Path

from steadylm.diagnose.findings import Diagnosis
from steadylm.diagnose.runlog import RunLog
from steadylm.plots import Mark, plot_heatmap, plot_series, plot_signals
from steadylm.stability.signals import SIGNALS, signal_values

KIND_COLORS = {
    "nonfinite_loss": "red",
    "nonfinite_grad": "red",
    "loss_spike": "orange",
    "update_ratio": "purple",
    "attn_logit": "brown",
    "fp16_skip_streak": "magenta",
    "rollback": "green",
    "lr_backoff": "teal",
    "stop": "black",
}


def _marks(log: RunLog, diagnosis: Diagnosis) -> list[Mark]:
    marks = [
        (int(e["step"]), e["kind"], KIND_COLORS.get(e["kind"], "grey")) for e in log.events if e["kind"] != "rollback"
    ]
    marks += [(step, f"reset to step {to}", KIND_COLORS["rollback"]) for step, to in log.restores()]
    if diagnosis.onset is not None:
        marks.append((diagnosis.onset, f"onset (step {diagnosis.onset})", "crimson"))
    return marks


def _blocks(log: RunLog, prefix: str) -> dict:
    return {t.rsplit("/", 1)[1]: log.series(t) for t in log.blocks(prefix)}


def _segments(log: RunLog, tag: str) -> dict:
    """`tag`'s curve cut at every reset (rollback, rewind), each piece its own line: the climb back to the
    restored state's loss is a jump between two pieces, never drawn as the loss rising."""
    steps, values = log.series(tag)
    cuts = [step for step, _ in log.restores()]
    if not cuts:
        return {tag: (steps, values)}
    edges = [-1, *cuts, int(steps[-1]) if len(steps) else 0]
    out = {}
    for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
        keep = (steps > lo) & (steps <= hi)
        label = tag if i == 0 else f"{tag} after reset {i} (to step {log.restores()[i - 1][1]})"
        out[label] = (steps[keep], values[keep])
    return out


def _signal_panels(log: RunLog) -> list[dict]:
    """The precursor signals this run measured, each with its level, its alarm spans and its forecasts."""
    by_step: dict[int, dict[str, float]] = {}
    for tag, (steps, values) in log.scalars.items():
        if tag.startswith("stability/"):
            for s, v in zip(steps, values):
                by_step.setdefault(int(s), {})[tag] = float(v)
    series = {s: signal_values(m, bool(log.setting("model.qk_norm", False))) for s, m in sorted(by_step.items())}
    events = [e for e in log.events if e["kind"] in ("precursor", "forecast")]
    every = int(log.setting("trainer.log_every_n_steps", 10) or 10)
    levels = log.setting("callbacks.stability.signals", {}) or {}
    panels = []
    for name in SIGNALS:
        points = [(s, v[name]) for s, v in series.items() if name in v]
        mine = [e for e in events if e["detail"].get("signal") == name]
        if not points or (not mine and levels.get(name) is None):
            continue
        spans: list[list[int]] = []
        for e in (e for e in mine if e["kind"] == "precursor"):
            if spans and e["step"] - spans[-1][1] <= every:
                spans[-1][1] = e["step"]
            else:
                spans.append([e["step"], e["step"]])
        level = mine[0]["detail"]["threshold"] if mine else levels.get(name)
        panels.append(
            {
                "label": name,
                "steps": [s for s, _ in points],
                "values": [v for _, v in points],
                "level": level,
                "spans": [(a - every / 2, b + every / 2) for a, b in spans],
                "forecasts": [
                    (e["step"], e["detail"]["value"], e["detail"]["expected_step"], e["detail"]["threshold"])
                    for e in mine
                    if e["kind"] == "forecast"
                ],
            }
        )
    return panels


def draw_plots(log: RunLog, diagnosis: Diagnosis, out: Path) -> dict[str, Path]:
    marks = _marks(log, diagnosis)
    plots = {
        "loss": plot_series(
            {**_segments(log, "train/loss"), "val/loss": log.series("val/loss")},
            out / "loss.png",
            title="loss",
            ylabel="cross-entropy (nats)",
            marks=marks,
        ),
        "lr": plot_series(
            {"optim/lr": log.series("optim/lr")}, out / "lr.png", title="learning rate", ylabel="LR", marks=marks
        ),
        "grad_norm": plot_series(
            {"optim/grad_norm (pre-clip)": log.series("optim/grad_norm")},
            out / "grad_norm.png",
            title="global grad norm",
            ylabel="norm",
            marks=marks,
            logy=True,
        ),
        "block_grad_norm": plot_heatmap(
            [(t.rsplit("/", 1)[1], *log.series(t)) for t in log.blocks("stability/grad_norm")],
            out / "block_grad_norm.png",
            title="per-block grad norm",
            marks=marks,
        ),
        "update_ratio": plot_series(
            {"global": log.series("stability/update_ratio"), **_blocks(log, "stability/update_ratio")},
            out / "update_ratio.png",
            title="update / param ratio",
            ylabel="|dθ|/|θ|",
            marks=marks,
            logy=True,
        ),
        "attn_logit": plot_series(
            _blocks(log, "stability/max_attn_logit"),
            out / "attn_logit.png",
            title="max attention logit",
            ylabel="logit",
            marks=marks,
        ),
    }
    panels = _signal_panels(log)
    if panels:
        plots["signals"] = plot_signals(
            panels, out / "signals.png", title="precursor signals (stability/events.jsonl: precursor, forecast)"
        )
    return plots


def _where(row: dict) -> str:
    """A suspect's shard, after its source's name under `data.sources`."""
    return f"{row['source']}: {row.get('shard')}" if row.get("source") else str(row.get("shard"))


def render(log: RunLog, diagnosis: Diagnosis, plots: dict[str, Path]) -> str:
    lines = [f"# Diagnosis of `{log.run_dir}`", ""]
    p = diagnosis.primary
    if p is None:
        lines += [
            "**No instability found.** The loss never left its best value for good and no stability event was logged.",
            "",
        ]
    else:
        lines += [f"**Onset: step {p.onset}.** **Cause: {p.cause}** — {p.summary} → {p.fix}", ""]
        if len(diagnosis.findings) > 1:
            lines += ["Also seen (later, likely consequences):", ""]
            lines += [f"- step {f.onset}: {f.cause} — {f.summary}" for f in diagnosis.findings[1:]]
            lines.append("")
    lines += ["## Facts", ""] + [f"- {fact}" for fact in diagnosis.facts] + [""]
    if log.events:
        lines += [
            "## Events (`stability/events.jsonl`)",
            "",
            "| step | kind | action | detail |",
            "| --- | --- | --- | --- |",
        ]
        for e in log.events[:50]:
            detail = ", ".join(f"{k}={v}" for k, v in e.get("detail", {}).items() if k != "batch" or v)
            lines.append(
                f"| {e.get('step')} | {e.get('kind')} | {e.get('action')} | {detail.replace('|', '/')[:200]} |"
            )
        if len(log.events) > 50:
            lines.append(f"| … | {len(log.events) - 50} more | | |")
        lines.append("")
    if log.suspects:
        lines += [
            "## Suspect samples (`stability/suspects.jsonl`)",
            "",
            "Each spike's samples ranked by their own loss on the pre-spike weights, worst first. Print one with "
            "`python -m steadylm.diagnose.window data.dir=<data.dir> shard=<shard> start=<start> end=<end>`.",
            "",
            "| step | rank | window | shard | start | end | loss | preview |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        shown: dict[int, int] = {}
        for r in sorted(log.suspects, key=lambda r: (r.get("step", 0), -(r.get("loss") or 0))):
            step = r.get("step")
            if shown.get(step, 0) >= 5:
                continue
            shown[step] = shown.get(step, 0) + 1
            preview = (r.get("preview") or "").replace("|", "/").replace("\n", " ").replace("\r", " ")[:60]
            lines.append(
                f"| {step} | {r.get('rank')} | {r.get('window')} | {_where(r)} | {r.get('start')} | "
                f"{r.get('end')} | {r.get('loss')} | `{preview}` |"
            )
        lines.append("")
    lines += ["## Plots", ""] + [f"![{name}]({path.name})" for name, path in plots.items()]
    return "\n".join(lines) + "\n"


def write_report(log: RunLog, diagnosis: Diagnosis) -> Path:
    plots = draw_plots(log, diagnosis, log.run_dir)
    path = log.run_dir / "report.md"
    path.write_text(render(log, diagnosis, plots))
    return path
