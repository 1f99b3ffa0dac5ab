"""Whether a finished run was unstable (`result.json`'s `unstable`), from `stability/events.jsonl` alone so `train.py`
and the sweep summary agree: a run that did not diverge may still have trained worse than its LR promised. Unstable:
any `lr_backoff`, `qk_clip` on `MATERIAL_CLIPS` steps, `attn_logit` alarms or a `precursor` past its level on
`PERSISTENT_ALARMS` steps, an `init_loss` event, or an `unrecovered` one (reset and cut short, not diverged).
"""

from __future__ import annotations

from pathlib import Path

from steadylm.stability.events import read_events

MATERIAL_CLIPS = 10
PERSISTENT_ALARMS = 5


def instability(run_dir: str | Path, lr: float | None = None) -> str | None:
    """One line, the cause and the fix, when the run was unstable; None when it was not."""
    events = read_events(run_dir)
    init = [e["detail"] for e in events if e.get("kind") == "init_loss"]
    if init:
        from steadylm.stability.init_loss import INIT_OTHERWISE, init_fix  # only a run with the check writes these

        d = init[0]
        return (
            f"the initial loss was {d['loss']:.3g} nats, ln({d['vocab_size']}) = {d['expected']:.3g} expected: the "
            f"init is wrong (over-confident logits); fix: {init_fix(d.get('init'), INIT_OTHERWISE)}"
        )
    precursors = [e for e in events if e.get("kind") == "precursor"]
    signal_backoffs = [e for e in events if e.get("kind") == "lr_backoff" and e["detail"].get("cause") != "qk_clip"]
    clips = [e for e in events if e.get("kind") == "qk_clip" and e.get("action") == "clip"]
    backoffs = [e for e in events if e.get("kind") == "lr_backoff"]
    alarms = [e for e in events if e.get("kind") == "attn_logit"]
    cut = next((cut_short(e["detail"]) for e in events if e.get("kind") == "unrecovered"), None)
    # Logits past the bar name the more specific cause (and QK-norm the fix); the signals speak when they are quiet.
    if not clips and not alarms and (signal_backoffs or len(precursors) >= PERSISTENT_ALARMS):
        return _precursor_reason(precursors, signal_backoffs, lr, cut)
    if not backoffs and len(clips) < MATERIAL_CLIPS and len(alarms) < PERSISTENT_ALARMS:
        return f"{cut}; fix: a longer run (trainer.max_steps) shows whether it recovers" if cut else None
    first = (clips or alarms or backoffs)[0]
    peak = max((float(e["detail"].get("max_logit", e["detail"].get("value", 0.0))) for e in clips + alarms), default=0)
    cause = f"attention logits grew past the bar from step {first['step']} (max {peak:.3g})"
    if clips:
        cause += f"; QK-clip acted on {len(clips)} steps"
    if backoffs:
        scale = float(backoffs[-1]["detail"]["lr_scale"])
        lower = f"optim.lr={lr * scale:.3g}" if lr else f"optim.lr x{scale:g}"
        cause += f", and lowered the LR {len(backoffs)} time(s) to x{scale:g}"
    else:
        lower = f"optim.lr={lr / 3:.3g}" if lr else "a lower optim.lr"
    if not clips and not backoffs:
        cause += f" on {len(alarms)} logging steps, unmitigated"
    cause += f"; {cut}" if cut else ""
    return f"{cause}; fix: model.qk_norm=true, or {lower} (python -m steadylm.doctor runs the LR probe)"


def cut_short(d: dict) -> str:
    """The `unrecovered` event in words: where the suite reset the run to, what it cost, where the run ended."""
    final = f" (last {d['final']:.3f})" if d.get("final") is not None else ""
    return (
        f"the suite reset the run at step {d['step']} to step {d['to_step']} ({d['lost_steps']} steps of progress) "
        f"and it ended {d['steps_after']} steps later, before its loss came back to its earlier best "
        f"{d['best_before']:.3f}{final}: cut short, not diverged"
    )


SIGNAL_CAUSES = {
    "residual_rms": "the residual stream's RMS grew past {level:g} (max {peak:.3g}; healthy runs stay O(1))",
    "update_ratio": "the update/param ratio stayed above {level:g} after the warmup (max {peak:.3g})",
    "log_z": "the output softmax's |log Z| drifted past {level:g} (max {peak:.3g})",
}


def _precursor_reason(precursors: list[dict], backoffs: list[dict], lr: float | None, cut: str | None) -> str:
    """The cause and fix of a run whose precursor signals fired (the first signal to fire names the cause)."""
    first = (precursors or backoffs)[0]
    signal = first["detail"].get("signal") or first["detail"].get("cause")
    mine = [e for e in precursors if e["detail"].get("signal") == signal]
    level = float(mine[0]["detail"]["threshold"]) if mine else float("nan")
    peak = max((float(e["detail"]["value"]) for e in mine), default=float("nan"))
    cause = SIGNAL_CAUSES.get(signal, f"{signal} passed its level {{level:g}} (max {{peak:.3g}})")
    cause = cause.format(level=level, peak=peak) + f" from step {first['step']}"
    if backoffs:
        scale = float(backoffs[-1]["detail"]["lr_scale"])
        cause += f"; the suite lowered the LR {len(backoffs)} time(s) to x{scale:g}"
        rewound = [e["detail"]["rewound_to"] for e in backoffs if "rewound_to" in e["detail"]]
        if rewound:
            cause += f" and rewound to step {rewound[0]}"
        lower = f"optim.lr={lr * scale:.3g}" if lr else f"optim.lr x{scale:g}"
    else:
        cause += f", on {len(mine)} stats steps, unmitigated"
        lower = f"optim.lr={lr / 10:.3g}" if lr else "a lower optim.lr"
    cause += f"; {cut}" if cut else ""
    return f"{cause}: the LR is too high; fix: {lower} (python -m steadylm.doctor runs the LR probe)"
