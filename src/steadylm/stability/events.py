"""The append-only events log, `<run_dir>/stability/events.jsonl`: one JSON line per detection or action; only
global rank 0 writes (all ranks reach the same decisions), each line flushed so a crash still leaves it on disk."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("steadylm.stability")

ACTIONS = ("log", "skip", "clip", "backoff", "rollback", "stop")


def stability_dir(trainer) -> Path:
    return Path(trainer.default_root_dir) / "stability"


def events_path(trainer) -> Path:
    return stability_dir(trainer) / "events.jsonl"


def start_events(trainer) -> None:
    """Create the (empty) log before training, so a run folder always has one; an existing log is kept."""
    (path := events_path(trainer)).parent.mkdir(parents=True, exist_ok=True)
    path.touch()


def emit(trainer, step: int, kind: str, action: str, detail: dict[str, Any] | None = None) -> None:
    """Append one event (rank 0 only) and echo it to the console log."""
    assert isinstance(kind, str) and kind and action in ACTIONS, (kind, action)
    if not trainer.is_global_zero:
        return
    event = {"step": int(step), "kind": kind, "action": action, "detail": detail or {}, "time": time.time()}
    (path := events_path(trainer)).parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:  # closed, so flushed, at once
        f.write(json.dumps(event) + "\n")
    log.warning("stability: step %d %s -> %s %s", step, kind, action, json.dumps(event["detail"]))


def read_events(run_dir: str | Path, notes: list[str] | None = None) -> list[dict]:
    """Every event of a run, in file order; a line cut short by a killed process is skipped (and noted)."""
    path, events = Path(run_dir) / "stability" / "events.jsonl", []
    for n, line in enumerate(path.read_text().splitlines() if path.exists() else [], 1):
        try:
            events.append(json.loads(line))
        except ValueError:
            if line.strip() and notes is not None:
                notes.append(f"{path}: line {n} is not JSON (torn write at a crash?); skipped")
    return events


def actions_done(events: list[dict]) -> str:
    """What the suite did about these events, in words, for diagnose: "skipped x2, rolled back"."""
    counts: dict[str, int] = {}
    for e in events:
        counts[e.get("action", "log")] = counts.get(e.get("action", "log"), 0) + 1
    done = {"skip": "skipped", "rollback": "rolled back", "stop": "stopped the run", "log": "logged"}
    return ", ".join(f"{done.get(a, a)} x{n}" if a in ("skip", "log") else done.get(a, a) for a, n in counts.items())


def stop_event(run_dir: str | Path) -> dict | None:
    """The event that stopped the run (its action `stop`: the run diverged), if any: the `stop` event itself (it
    carries the reason), else the first detection whose action was to stop."""
    stops = [e for e in read_events(run_dir) if e.get("action") == "stop"]
    return next((e for e in stops if e.get("kind") == "stop"), stops[0] if stops else None)
