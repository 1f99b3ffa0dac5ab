"""PNG plots for `doctor` and `diagnose`, drawn with matplotlib's file-only Agg backend.

Agg needs no display, so the plots render the same on a headless GPU node, in CI and in a notebook.
Every function writes one PNG and returns its path; none of them reads run files itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

if TYPE_CHECKING:
    from steadylm.schedule import Schedule


def _save(fig, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_lr_schedule(lrs: Sequence[float], schedule: Schedule, path: Path) -> Path:
    """The LR per step, with the end of warmup and (wsd) the start of the decay marked."""
    fig, ax = plt.subplots(figsize=(7, 3))
    ax.plot(range(len(lrs)), lrs, label=schedule.shape)
    if schedule.warmup_steps:
        ax.axvline(schedule.warmup_steps, color="grey", ls=":", label=f"end of warmup ({schedule.warmup_steps})")
    if schedule.shape == "wsd":
        ax.axvline(schedule.decay_start, color="C1", ls="--", label=f"decay starts ({schedule.decay_start})")
    ax.legend()
    ax.set(xlabel="optimizer step", ylabel="learning rate", title=schedule.describe())
    ax.title.set_fontsize(9)
    return _save(fig, path)


Mark = tuple[int, str, str]  # (step, label, color): an event or the onset, drawn as a vertical line


def _marks(ax, marks: Sequence[Mark]) -> None:
    labelled = set()
    for step, label, color in marks:
        ax.axvline(step, color=color, ls="--", lw=1, alpha=0.8, label=None if label in labelled else label)
        labelled.add(label)


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"{what}: not logged in this run", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])


def plot_series(
    series: dict, path: Path, *, title: str, ylabel: str, marks: Sequence[Mark] = (), logy: bool = False
) -> Path:
    """Line plot of {label: (steps, values)} with event marks; a placeholder when nothing was logged."""
    fig, ax = plt.subplots(figsize=(8, 3.5))
    series = {k: v for k, v in series.items() if len(v[0])}
    if not series:
        _empty(ax, title)
        return _save(fig, path)
    for label, (steps, values) in series.items():
        ax.plot(steps, values, label=label, lw=1.2)
    if logy:
        ax.set_yscale("log")
    _marks(ax, marks)
    ax.set(xlabel="optimizer step", ylabel=ylabel, title=title)
    ax.legend(fontsize=8, loc="best")
    return _save(fig, path)


def plot_heatmap(
    rows: Sequence[tuple[str, Sequence[int], Sequence[float]]], path: Path, *, title: str, marks: Sequence[Mark] = ()
) -> Path:
    """Rows (one per block) of log10 values over steps; columns are the union of logged steps."""
    import numpy as np

    fig, ax = plt.subplots(figsize=(8, 0.6 * max(len(rows), 3) + 1.5))
    steps = sorted({int(s) for _, st, _ in rows for s in st})
    if not steps:
        _empty(ax, title)
        return _save(fig, path)
    col = {s: i for i, s in enumerate(steps)}
    grid = np.full((len(rows), len(steps)), np.nan)
    for r, (_, st, vals) in enumerate(rows):
        for s, v in zip(st, vals):
            grid[r, col[int(s)]] = np.log10(v) if v > 0 and np.isfinite(v) else np.nan
    im = ax.imshow(
        grid,
        aspect="auto",
        interpolation="nearest",
        cmap="viridis",
        extent=(steps[0] - 0.5, steps[-1] + 0.5, len(rows) - 0.5, -0.5),
    )
    fig.colorbar(im, ax=ax, label="log10")
    ax.set_yticks(range(len(rows)), [label for label, _, _ in rows])
    _marks(ax, marks)
    ax.set(xlabel="optimizer step", title=title)
    return _save(fig, path)


# {"label", "steps", "values", "level", "spans": [(start, end)], "logy",
#  "forecasts": [(step, value, expected step, threshold)]}
Panel = dict


def plot_signals(panels: Sequence[Panel], path: Path, *, title: str, marks: Sequence[Mark] = ()) -> Path:
    """One panel per precursor signal: its values (log scale where it spans orders of magnitude), its alarm
    level as a red line, the spans it stayed past it shaded, and each forecast as a dotted line at its step and a
    dashed line from its value to the level at the step it expected, against the curve that came."""
    import numpy as np

    fig, axes = plt.subplots(max(len(panels), 1), 1, figsize=(8, 2.6 * max(len(panels), 1)), sharex=True, squeeze=False)
    if not panels:
        _empty(axes[0][0], title)
        return _save(fig, path)
    for ax, p in zip(axes[:, 0], panels):
        steps, values = np.asarray(p["steps"]), np.asarray(p["values"], dtype=float)
        ax.plot(steps, values, lw=1.2, label=p["label"])
        positive = values[np.isfinite(values) & (values > 0)]
        if p.get("logy", True) and len(positive) and positive.max() / positive.min() > 30:
            ax.set_yscale("log")
        if p.get("level") is not None:
            ax.axhline(p["level"], color="red", lw=1, ls="-", label=f"alarm level {p['level']:g}")
        for i, (a, b) in enumerate(p.get("spans", [])):
            ax.axvspan(a, b, color="red", alpha=0.15, label="past the level" if i == 0 else None)
        for i, (s, value, expected, threshold) in enumerate(p.get("forecasts", [])):
            ax.axvline(s, color="darkorange", ls=":", lw=1.5, label="forecast" if i == 0 else None)
            ax.plot([s, expected], [value, threshold], color="darkorange", ls="--", lw=1.2, marker="o", ms=3)
        _marks(ax, marks)
        ax.set(ylabel=p["label"])
        ax.legend(fontsize=7, loc="best")
    axes[-1][0].set(xlabel="optimizer step")
    axes[0][0].set_title(title)
    return _save(fig, path)
