"""What a run's events mean, in one place: whether a finished run was unstable (`result.json`'s `unstable`, from
`stability/events.jsonl` alone so `train.py` and the sweep summary agree) and what `diagnose` finds in them.

Each check interprets its own events in its own file, a built-in as a user's: `explain(events, lr, cut)` gives the
cause and the fix of an unstable run (None when its events were not material), `describe(events, log)` diagnose's
findings. The built-in ones are listed below; a check named in config (`callbacks.stability.checks.<name>`) is found
through the run's config, its events being of kind `<name>`. A module is loaded only when the run has its events; an
`unrecovered` event (reset and cut short, not diverged) is unstable on its own."""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from pathlib import Path
from typing import Any

from steadylm.stability.events import read_events

# The built-in checks' modules and the event kinds that wake them, in the order their causes are named: a wrong init
# first, then what acted on the weights, then the alarms and precursor signals, then the attention logits.
BUILT_IN = (
    ("steadylm.stability.init_loss", ("init_loss",)),
    ("steadylm.stability.guard", ("nonfinite_loss", "nonfinite_grad")),
    ("steadylm.stability.loss_scale", ("fp16_skip_streak",)),
    ("steadylm.stability.spike", ("loss_spike",)),
    ("steadylm.stability.stats", ("update_ratio", "attn_logit")),
    ("steadylm.stability.signals", ("precursor", "forecast", "lr_backoff")),
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


def interpreters(events: list[dict], checks: Mapping[str, str] | None = None) -> list[tuple[Any, list[dict], bool]]:
    """(the module or class that interprets them, the events it reads, whether it is the run's own) for every check
    whose events the run has. An event belongs to the run's own check `<name>` when its kind is `<name>` or it is an
    action taken for it (`detail.cause == <name>`: its backoff, rollback, skip, stop); the built-ins read every other
    event (a spike's cause may be an update-ratio alarm), the run's own checks theirs alone; an owner is None where
    its code cannot be imported."""
    names = set(checks or {})
    owned = {n: [e for e in events if e.get("kind") == n or (e.get("detail") or {}).get("cause") == n] for n in names}
    mine = {id(e) for own in owned.values() for e in own}
    rest = [e for e in events if id(e) not in mine]
    kinds = {e.get("kind") for e in rest}
    out = [(import_module(m), rest, False) for m, wake in BUILT_IN if kinds.intersection(wake)]
    return out + [(_owner(checks[n]), owned[n], True) for n in sorted(names) if owned[n]]


def instability(run_dir: str | Path, lr: float | None = None, checks: Mapping[str, str] | None = None) -> str | None:
    """One line, the cause and the fix, when the run was unstable; None when it was not. `checks`: the run's own
    checks (`config_checks`), asked after the built-ins."""
    events = read_events(run_dir)
    cut = next((cut_short(e["detail"]) for e in events if e.get("kind") == "unrecovered"), None)
    for owner, own, _ in interpreters(events, checks):
        explain = getattr(owner, "explain", None)
        if explain is not None and (line := explain(own, lr, cut)):
            return line
    return f"{cut}; fix: a longer run (trainer.max_steps) shows whether it recovers" if cut else None


def described(events: list[dict], log, checks: Mapping[str, str] | None = None) -> list[dict]:
    """diagnose's findings (onset, cause, summary, fix, optional rank) from every check that has events: each one's
    `describe(events, log)`; a run's own check without one gets its `explain` line, else its first event."""
    out = []
    for owner, own, mine in interpreters(events, checks):
        if hasattr(owner, "describe"):
            out += owner.describe(own, log)
        elif mine:
            name = own[0]["kind"]
            line = owner.explain(own, None, None) if hasattr(owner, "explain") else None
            cause, _, fix = (line or "").partition("; fix: ")
            summary = cause or f"{len(own)} {name} event(s) from step {own[0]['step']}: {own[0].get('detail')}"
            out.append(
                {"onset": own[0]["step"], "cause": name, "summary": summary, "fix": fix or f"see the {name} check"}
            )
    return out


def cut_short(d: dict) -> str:
    """The `unrecovered` event in words: where the suite reset the run to, what it cost, where the run ended."""
    final = f" (last {d['final']:.3f})" if d.get("final") is not None else ""
    return (
        f"the suite reset the run at step {d['step']} to step {d['to_step']} ({d['lost_steps']} steps of progress) "
        f"and it ended {d['steps_after']} steps later, before its loss came back to its earlier best "
        f"{d['best_before']:.3f}{final}: cut short, not diverged"
    )
