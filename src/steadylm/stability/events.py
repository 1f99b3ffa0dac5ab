"""The append-only events log: `<run_dir>/stability/events.jsonl`, one JSON object per line.

Every detection and action of the stability callbacks goes through `emit`, so `diagnose` and the
tests read one file. Only global rank 0 writes (all ranks reach the same decisions), and each line
is flushed as it is written so a crash right after an event still leaves it on disk.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("steadylm.stability")

# The built-in kinds; a check named in config (`callbacks.stability.checks.<name>`) writes `<name>` events.
KINDS = (
    "nonfinite_loss",
    "nonfinite_grad",
    "loss_spike",
    "update_ratio",
    "attn_logit",
    "fp16_skip_streak",
    "qk_clip",
    "lr_backoff",
    "precursor",
    "forecast",
    "init_loss",
    "rollback",
    "unrecovered",  # the run ended before its loss came back to where it was before the suite's last restore
    "stop",
)
STOP = "stop"  # the action of an event that ended the run (`sweep` reads it: the run diverged)
ACTIONS = ("log", "skip", "clip", "backoff", "rollback", "stop")


def stability_dir(trainer) -> Path:
    return Path(trainer.default_root_dir) / "stability"


def events_path(trainer) -> Path:
    return stability_dir(trainer) / "events.jsonl"


def start_events(trainer) -> Path:
    """Create the (empty) log before training, so a run folder always has one; an existing log is kept."""
    path = events_path(trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch()
    return path


def emit(trainer, step: int, kind: str, action: str, detail: dict[str, Any] | None = None) -> None:
    """Append one event (rank 0 only) and echo it to the console log."""
    assert isinstance(kind, str) and kind and action in ACTIONS, (kind, action)
    if not trainer.is_global_zero:
        return
    event = {"step": int(step), "kind": kind, "action": action, "detail": detail or {}, "time": time.time()}
    path = events_path(trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(event) + "\n")
        f.flush()
    log.warning("stability: step %d %s -> %s %s", step, kind, action, json.dumps(detail or {}))


def read_events(run_dir: str | Path, notes: list[str] | None = None) -> list[dict]:
    """Every event of a run, in file order; a line cut short by a killed process is skipped (and noted)."""
    path = Path(run_dir) / "stability" / "events.jsonl"
    if not path.exists():
        return []
    events = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            events.append(json.loads(line))
        except ValueError:
            if notes is not None:
                notes.append(f"{path}: line {n} is not JSON (torn write at a crash?); skipped")
    return events


def stop_event(run_dir: str | Path) -> dict | None:
    """The event that stopped the run, if any: the `stop` event itself (it carries the reason), else the first
    detection whose action was to stop."""
    stops = [e for e in read_events(run_dir) if e.get("action") == STOP]
    return next((e for e in stops if e.get("kind") == "stop"), stops[0] if stops else None)
