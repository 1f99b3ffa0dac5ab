"""What a run left on disk, loaded tolerantly: scalars by tag, stability events, the run config.

Every piece may be missing or cut short (a crash mid-write): missing tags are absent keys, a torn
last line of `events.jsonl` is dropped, and a resumed or rolled-back run's repeated steps keep the
value written last.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from steadylm.run_config import RUN_CONFIG, read_run_config
from steadylm.stability.events import read_events
from steadylm.stability.suspects import read_suspects


@dataclass
class RunLog:
    run_dir: Path
    scalars: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # tag -> (steps, values)
    events: list[dict] = field(default_factory=list)
    suspects: list[dict] = field(default_factory=list)  # stability/suspects.jsonl rows, worst first per step
    config: dict | None = None
    notes: list[str] = field(default_factory=list)  # what was missing or unreadable

    def series(self, tag: str) -> tuple[np.ndarray, np.ndarray]:
        return self.scalars.get(tag, (np.zeros(0, int), np.zeros(0)))

    def blocks(self, prefix: str) -> list[str]:
        """`prefix/block_0`, `prefix/block_1`, ... in block order."""
        tags = [t for t in self.scalars if t.startswith(prefix + "/block_")]
        return sorted(tags, key=lambda t: int(t.rsplit("_", 1)[1]))

    def restores(self) -> list[tuple[int, int]]:
        """(step, to_step) of every rollback or rewind: where the suite reset the weights to an earlier state."""
        return [(int(e["step"]), int(e["detail"]["to_step"])) for e in self.events if e.get("kind") == "rollback"]

    def loss_onset(self) -> int | None:
        """First logged step where train/loss is non-finite or leaves its best value for good. A rollback or rewind
        resets the best: the loss that rises back to the restored state's level is the reset, not a divergence."""
        steps, loss = self.series("train/loss")
        resets = sorted(step for step, _ in self.restores())
        best = math.inf
        for i, (s, v) in enumerate(zip(steps, loss)):
            if not math.isfinite(v):
                return int(s)
            if resets and s > resets[0]:
                resets = [r for r in resets if r >= s]
                best = math.inf
            margin = max(1.0, 0.2 * best) if math.isfinite(best) else math.inf
            ahead = loss[i : i + 5]
            if v > best + margin and not (np.isfinite(ahead) & (ahead <= best + margin / 2)).any():
                return int(s)
            best = min(best, v)
        return None

    def setting(self, dotted: str, default: Any = None) -> Any:
        node = self.config
        for key in dotted.split("."):
            if not isinstance(node, dict) or key not in node:
                return default
            node = node[key]
        return node


def _read_scalars(run_dir: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every scalar the run's loggers wrote: TensorBoard event files and/or CSV (`logger=csv|wandb|many`)."""
    by_tag: dict[str, dict[int, tuple[float, float]]] = {}

    def add(tag: str, step: int, when: float, value: float) -> None:
        seen = by_tag.setdefault(tag, {})
        if step not in seen or when >= seen[step][0]:  # a resumed or rolled-back run: the value written last
            seen[step] = (when, value)

    _read_tensorboard(run_dir, add)
    _read_csv(run_dir, add)
    return {
        tag: (np.array(sorted(seen), dtype=int), np.array([seen[s][1] for s in sorted(seen)], dtype=float))
        for tag, seen in by_tag.items()
    }


def _read_tensorboard(run_dir: Path, add) -> None:
    folders = sorted({p.parent for p in run_dir.rglob("events.out.tfevents.*")})
    if not folders:
        return
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for folder in folders:
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            for e in acc.Scalars(tag):
                add(tag, e.step, e.wall_time, e.value)


def _read_csv(run_dir: Path, add) -> None:
    """Lightning's CSVLogger: one row per logging call, a `step` column; rows later in the file are newer."""
    import csv

    for path in sorted(run_dir.rglob("metrics.csv")):
        with path.open(newline="") as f:
            for order, row in enumerate(csv.DictReader(f)):
                step = row.pop("step", "")
                if not step:
                    continue
                for tag, text in row.items():
                    if text not in ("", None) and tag != "epoch":
                        add(tag, int(float(step)), float(order), float(text))


def _read_events(run_dir: Path, notes: list[str]) -> list[dict]:
    return sorted(read_events(run_dir, notes), key=lambda e: e.get("step", 0))


def load_run(run_dir) -> RunLog:
    run_dir = Path(run_dir)
    log = RunLog(run_dir)
    log.scalars = _read_scalars(run_dir)
    if not log.scalars:
        log.notes.append(f"no TensorBoard event files under {run_dir} (was logger=none, or did it crash at once?)")
    log.events = _read_events(run_dir, log.notes)
    log.suspects = read_suspects(run_dir)
    try:
        log.config = read_run_config(run_dir)
    except Exception as err:  # an unreadable config only costs the report its clipping/warmup facts
        log.notes.append(f"run config unreadable ({type(err).__name__}: {err})")
    if log.config is None:
        log.notes.append(f"no run config ({RUN_CONFIG} or a checkpoint); clipping and warmup are unknown")
    return log
