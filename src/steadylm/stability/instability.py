"""Whether a finished run was unstable (`result.json`'s `unstable`), from `stability/events.jsonl` alone so `train.py`
and the sweep summary agree: a run that did not diverge may still have trained worse than its LR promised. Each check
whose events can make a run unstable explains them in its own file (`explain(events, lr, cut)`: the cause and the fix,
or None when its events were not material), loaded only when the run has such events; an `unrecovered` event (reset
and cut short, not diverged) is unstable on its own."""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from steadylm.stability.events import read_events

# The checks that explain their events, in the order their causes are named: a wrong init first, then the precursor
# signals (when the attention logits are quiet), then the attention logits.
EXPLAINERS = (
    ("steadylm.stability.init_loss", ("init_loss",)),
    ("steadylm.stability.signals", ("precursor", "lr_backoff")),
    ("steadylm.stability.qk_clip", ("qk_clip", "attn_logit", "lr_backoff")),
)


def instability(run_dir: str | Path, lr: float | None = None) -> str | None:
    """One line, the cause and the fix, when the run was unstable; None when it was not."""
    events = read_events(run_dir)
    kinds = {e.get("kind") for e in events}
    cut = next((cut_short(e["detail"]) for e in events if e.get("kind") == "unrecovered"), None)
    for module, triggers in EXPLAINERS:
        if kinds.intersection(triggers) and (line := import_module(module).explain(events, lr, cut)):
            return line
    return f"{cut}; fix: a longer run (trainer.max_steps) shows whether it recovers" if cut else None


def cut_short(d: dict) -> str:
    """The `unrecovered` event in words: where the suite reset the run to, what it cost, where the run ended."""
    final = f" (last {d['final']:.3f})" if d.get("final") is not None else ""
    return (
        f"the suite reset the run at step {d['step']} to step {d['to_step']} ({d['lost_steps']} steps of progress) "
        f"and it ended {d['steps_after']} steps later, before its loss came back to its earlier best "
        f"{d['best_before']:.3f}{final}: cut short, not diverged"
    )
