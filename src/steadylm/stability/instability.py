"""What a run's events mean, in one place: whether a finished run was unstable (`result.json`'s `unstable`, from
`stability/events.jsonl` alone so `train.py` and the sweep summary agree) and what `diagnose` says of a check's events.

Each check interprets its own events in its own file: `explain(events, lr, cut)` gives the cause and the fix (None
when its events were not material), `describe(events)` diagnose's findings. The built-in ones are listed below; a
check named in config (`callbacks.stability.checks.<name>`) is found through the run's config, its events being of
kind `<name>`. A module is loaded only when the run has its events; an `unrecovered` event (reset and cut short, not
diverged) is unstable on its own."""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from pathlib import Path
from typing import Any

from steadylm.stability.events import read_events

# The built-in checks that explain their events, in the order their causes are named: a wrong init first, then the
# precursor signals (when the attention logits are quiet), then the attention logits.
EXPLAINERS = (
    ("steadylm.stability.init_loss", ("init_loss",)),
    ("steadylm.stability.signals", ("precursor", "lr_backoff")),
    ("steadylm.stability.qk_clip", ("qk_clip", "attn_logit", "lr_backoff")),
)


def config_checks(config: Mapping | None) -> dict[str, str]:
    """{name: `_target_`} of the checks a run's config names under `callbacks.stability.checks`."""
    node: Any = config
    for key in ("callbacks", "stability", "checks"):
        node = node.get(key) if isinstance(node, Mapping) else None
    node = node if isinstance(node, Mapping) else {}
    return {str(n): str(c["_target_"]) for n, c in node.items() if isinstance(c, Mapping) and "_target_" in c}


def _owner(target: str) -> Any:
    """The check's class; None where it cannot be imported (a run diagnosed away from its code): its events are
    then described by their detail alone."""
    module, _, name = target.replace(":", ".").rpartition(".")
    try:
        return getattr(import_module(module), name)
    except (ImportError, AttributeError):
        return None


def interpreters(kinds: set, checks: Mapping[str, str] | None = None) -> list[tuple[tuple[str, ...], Any]]:
    """(event kinds, the module or class that interprets them) for the kinds in `kinds`: built-ins first."""
    out = [(t, import_module(m)) for m, t in EXPLAINERS if kinds.intersection(t)]
    mine = [((name,), _owner(target)) for name, target in (checks or {}).items() if name in kinds]
    return out + [(kinds, owner) for kinds, owner in mine if owner is not None]


def instability(run_dir: str | Path, lr: float | None = None, checks: Mapping[str, str] | None = None) -> str | None:
    """One line, the cause and the fix, when the run was unstable; None when it was not. `checks`: the run's own
    checks (`config_checks`), whose `explain` is asked after the built-ins', with its own events."""
    events = read_events(run_dir)
    cut = next((cut_short(e["detail"]) for e in events if e.get("kind") == "unrecovered"), None)
    for kinds, owner in interpreters({e.get("kind") for e in events}, checks):
        explain = getattr(owner, "explain", None)
        own = [e for e in events if e.get("kind") in kinds] if kinds[0] in (checks or {}) else events
        if explain is not None and (line := explain(own, lr, cut)):
            return line
    return f"{cut}; fix: a longer run (trainer.max_steps) shows whether it recovers" if cut else None


def described(events: list[dict], checks: Mapping[str, str] | None = None) -> list[dict]:
    """diagnose's findings (onset, cause, summary, fix) from the run's own checks: each one's `describe(events)`, else
    its first event and its `explain` line."""
    out = []
    mine = {e.get("kind") for e in events} & set(checks or {})
    for name in sorted(mine):
        owner = _owner(checks[name])
        own = [e for e in events if e.get("kind") == name]
        if hasattr(owner, "describe"):
            out += owner.describe(own)
            continue
        line = owner.explain(own, None, None) if hasattr(owner, "explain") else None
        cause, _, fix = (line or "").partition("; fix: ")
        summary = cause or f"{len(own)} {name} event(s) from step {own[0]['step']}: {own[0].get('detail')}"
        out.append({"onset": own[0]["step"], "cause": name, "summary": summary, "fix": fix or f"see the {name} check"})
    return out


def cut_short(d: dict) -> str:
    """The `unrecovered` event in words: where the suite reset the run to, what it cost, where the run ended."""
    final = f" (last {d['final']:.3f})" if d.get("final") is not None else ""
    return (
        f"the suite reset the run at step {d['step']} to step {d['to_step']} ({d['lost_steps']} steps of progress) "
        f"and it ended {d['steps_after']} steps later, before its loss came back to its earlier best "
        f"{d['best_before']:.3f}{final}: cut short, not diverged"
    )
