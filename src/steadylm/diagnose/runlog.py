"""What a run left on disk, loaded tolerantly: scalars by tag, stability events, the run config.

Every piece may be missing or cut short (a crash mid-write): missing tags are absent keys, a torn
last line of `events.jsonl` is dropped, and a resumed or rolled-back run's repeated steps keep the
value written last.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

EVENTS = Path("stability") / "events.jsonl"


@dataclass
class RunLog:
    run_dir: Path
    scalars: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # tag -> (steps, values)
    events: list[dict] = field(default_factory=list)
    config: dict | None = None
    notes: list[str] = field(default_factory=list)  # what was missing or unreadable

    def series(self, tag: str) -> tuple[np.ndarray, np.ndarray]:
        return self.scalars.get(tag, (np.zeros(0, int), np.zeros(0)))

    def blocks(self, prefix: str) -> list[str]:
        """`prefix/block_0`, `prefix/block_1`, ... in block order."""
        tags = [t for t in self.scalars if t.startswith(prefix + "/block_")]
        return sorted(tags, key=lambda t: int(t.rsplit("_", 1)[1]))

    def setting(self, dotted: str, default=None):
        node = self.config
        for key in dotted.split("."):
            if not isinstance(node, dict) or key not in node:
                return default
            node = node[key]
        return node


def _read_scalars(run_dir: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = sorted({p.parent for p in run_dir.rglob("events.out.tfevents.*")})
    by_tag: dict[str, dict[int, tuple[float, float]]] = {}
    for folder in folders:
        acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            seen = by_tag.setdefault(tag, {})
            for e in acc.Scalars(tag):
                if e.step not in seen or e.wall_time >= seen[e.step][0]:
                    seen[e.step] = (e.wall_time, e.value)
    return {
        tag: (np.array(sorted(seen), dtype=int), np.array([seen[s][1] for s in sorted(seen)], dtype=float))
        for tag, seen in by_tag.items()
    }


def _read_events(path: Path, notes: list[str]) -> list[dict]:
    events = []
    if not path.exists():
        return events
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            notes.append(f"{path}: line {n} is not JSON (torn write at a crash?); skipped")
    return sorted(events, key=lambda e: e.get("step", 0))


def _read_config(run_dir: Path) -> dict | None:
    """The composed config: Hydra's `.hydra/config.yaml`, else the one every checkpoint carries."""
    hydra_cfg = run_dir / ".hydra" / "config.yaml"
    if hydra_cfg.exists():
        return yaml.safe_load(hydra_cfg.read_text())
    for ckpt in sorted((run_dir / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True):
        import torch

        try:
            return torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)["steadylm"]["config"]
        except Exception:
            continue
    return None


def load_run(run_dir) -> RunLog:
    run_dir = Path(run_dir)
    log = RunLog(run_dir)
    log.scalars = _read_scalars(run_dir)
    if not log.scalars:
        log.notes.append(f"no TensorBoard event files under {run_dir} (was logger=none, or did it crash at once?)")
    log.events = _read_events(run_dir / EVENTS, log.notes)
    try:
        log.config = _read_config(run_dir)
    except Exception as err:  # an unreadable config only costs the report its clipping/warmup facts
        log.notes.append(f"run config unreadable ({type(err).__name__}: {err})")
    if log.config is None:
        log.notes.append("no run config (.hydra/config.yaml or a checkpoint); clipping and warmup are unknown")
    return log
