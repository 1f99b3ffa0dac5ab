"""From a run's log to its diagnosis: the onset step of a divergence and the most likely cause.

Stability events are first-hand evidence (the callback saw the non-finite module, the spike, the
skipped fp16 steps), so each event kind maps to a cause directly. The curves are the fallback, and
also catch what no event describes: a loss that leaves its best value for good, with the grad norm,
the LR and the run's clipping/warmup settings at that step telling the likely reason. When several
explanations exist the earliest onset wins, because what comes after is usually its consequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from steadylm.diagnose.runlog import RunLog
from steadylm.stability.instability import config_checks, cut_short, described, instability

NONFINITE = ("nonfinite_loss", "nonfinite_grad")
LOOKBACK = 50  # steps of grad-norm history compared at the onset
EVENT_SLACK = 3  # a curve onset must precede an event by more than this to be the better explanation


@dataclass
class Finding:
    onset: int
    cause: str  # short name, e.g. "non-finite forward"
    summary: str  # what happened, with numbers
    fix: str
    rank: int = 0  # 0: first-hand event, 1: inferred from the curves, 2: a symptom alarm, 3: a forecast alone


@dataclass
class Diagnosis:
    findings: list[Finding] = field(default_factory=list)  # primary first
    facts: list[str] = field(default_factory=list)  # context lines for the report

    @property
    def primary(self) -> Finding | None:
        return self.findings[0] if self.findings else None

    @property
    def onset(self) -> int | None:
        return self.primary.onset if self.primary else None


def _actions(events: list[dict]) -> str:
    counts: dict[str, int] = {}
    for e in events:
        counts[e.get("action", "log")] = counts.get(e.get("action", "log"), 0) + 1
    done = {"skip": "skipped", "rollback": "rolled back", "stop": "stopped the run", "log": "logged"}
    return ", ".join(f"{done.get(a, a)} x{n}" if a in ("skip", "log") else done.get(a, a) for a, n in counts.items())


def _nonfinite(events: list[dict]) -> Finding | None:
    hits = [e for e in events if e["kind"] in NONFINITE]
    if not hits:
        return None
    first = hits[0]
    module = first.get("detail", {}).get("module")
    acted = _actions(hits)
    evidence = first.get("detail", {}).get("evidence") or ""
    if module is None and evidence.startswith("transient"):
        return Finding(
            first["step"],
            "transient non-finite",
            f"non-finite {'loss' if first['kind'] == 'nonfinite_loss' else 'gradient'} at step {first['step']}, "
            f"{evidence}: no module is named ({acted})",
            "a one-off (the step was skipped); if it recurs, run from the last checkpoint with debug=anomaly",
        )
    module = module or "an unnamed module"
    if first["kind"] == "nonfinite_loss":
        return Finding(
            first["step"],
            "non-finite forward",
            f"first non-finite output in {module} at step {first['step']} ({acted})",
            f"a weight or activation in {module} became NaN/inf: read stability/forensics/, "
            "re-run from the last good checkpoint with debug=anomaly",
        )
    return Finding(
        first["step"],
        "non-finite gradient",
        f"first non-finite gradient in {module} at step {first['step']} with a finite loss ({acted})",
        f"the backward pass through {module} overflowed: check its inputs and scale, prefer bf16-mixed "
        "over fp16, run with debug=anomaly to name the op",
    )


def _fp16(events: list[dict]) -> Finding | None:
    hits = [e for e in events if e["kind"] == "fp16_skip_streak"]
    if not hits:
        return None
    first, d = hits[0], hits[0].get("detail", {})
    n = int(d.get("consecutive", 1))
    return Finding(
        first["step"] - n + 1,
        "fp16 loss-scale overflow",
        f"{n} consecutive fp16 steps skipped (gradients overflowed) ending at step {first['step']}, "
        f"loss scale {d.get('loss_scale', float('nan')):g}",
        "use trainer.precision=bf16-mixed; with fp16, start the scaler lower and keep clipping on",
    )


def _recovered(log: RunLog, step: int) -> bool:
    """Did train/loss come back to its pre-spike level within a few logged points?"""
    steps, loss = log.series("train/loss")
    before = loss[(steps < step) & np.isfinite(loss)]
    after = loss[steps > step][:5]
    if len(before) == 0 or len(after) == 0:
        return True
    return bool(np.isfinite(after).all() and np.median(after) <= np.min(before[-10:]) + 0.5)


def _suspects(log: RunLog, step: int) -> str:
    rows = [r for r in log.suspects if r.get("step") == step]
    if not rows:
        return ""
    top = rows[0]
    source = f"source {top['source']}, " if top.get("source") else ""  # data.sources
    return (
        f"; worst sample: window {top.get('window')} ({source}{top.get('shard')} tokens {top.get('start')}:{top.get('end')}, "
        f"loss {top.get('loss')})"
    )


def _spike(log: RunLog, events: list[dict]) -> Finding | None:
    hits = [e for e in events if e["kind"] == "loss_spike"]
    if not hits:
        return None
    s = hits[0]["step"]
    d = hits[0].get("detail", {})
    value = f"loss {d.get('value', float('nan')):.3g} > {d.get('threshold', float('nan')):.3g}"
    big_update = [e for e in events if e["kind"] == "update_ratio" and s - EVENT_SLACK <= e["step"] <= s]
    cause, evidence = d.get("cause"), d.get("evidence")
    rolled = [e for e in events if e["kind"] == "rollback" and e.get("detail", {}).get("onset") == s]
    after = (
        f"; rolled back to step {rolled[0]['detail'].get('to_step')} ({rolled[0]['detail'].get('source')})"
        if rolled
        else ""
    )
    if cause == "update":
        ratio = (
            f"update/param ratio {big_update[0]['detail'].get('value', float('nan')):.3g} at step "
            f"{big_update[0]['step']}, "
            if big_update
            else ""
        )
        return Finding(
            big_update[0]["step"] if big_update else s - 1,
            "oversized update (LR spike)",
            f"{ratio}then {value} at step {s}, persisting; {evidence}{after} ({_actions(hits)})",
            "check the LR the optimizer really used (scheduler state after a resume, a manual LR change); "
            "lower optim.lr if it recurs",
        )
    if cause == "data":
        windows = d.get("batch")
        on = f" on data window(s) {windows}" if windows else ""
        return Finding(
            s,
            "bad data batch",
            f"{value} at step {s}{on}, {_actions(hits)}; {evidence}{after}{_suspects(log, s)}",
            "inspect the top rows of stability/suspects.jsonl (`python -m steadylm.diagnose.window "
            "shard=... start=... end=... data.dir=...`) and clean or drop them from the corpus",
        )
    if cause == "inconclusive":
        return Finding(
            s,
            "loss spike (cause inconclusive)",
            f"{value} at step {s}, {_actions(hits)}; {evidence}{after}{_suspects(log, s)}",
            "read stability/suspects.jsonl and the update/param ratio around that step",
        )
    if big_update or not _recovered(log, s):
        ratio = (
            f"update/param ratio {big_update[0]['detail'].get('value', float('nan')):.3g} at step {big_update[0]['step']}, "
            if big_update
            else ""
        )
        return Finding(
            s - 1 if not big_update else big_update[0]["step"],
            "oversized update (LR spike)",
            f"{ratio}then {value} at step {s} and the loss did not recover: one update moved the weights too far "
            f"({_actions(hits)})",
            "check the LR the optimizer really used (scheduler state after a resume, a manual LR change); "
            "lower optim.lr; callbacks.stability.spike.action=rollback undoes such a step",
        )
    windows = d.get("batch")
    on = f" on data window(s) {windows}" if windows else ""
    return Finding(
        s,
        "bad data batch",
        f"{value} at step {s}{on}, {_actions(hits)}; the loss recovered at once",
        "inspect those windows in the shards; callbacks.stability.spike.action=skip (or rollback) keeps them out of the weights",
    )


def _alarms(events: list[dict]) -> list[Finding]:
    """Update-ratio and attention-logit alarms: symptoms (rank 2), the cause only when nothing else explains them."""
    found = []
    logits = [e for e in events if e["kind"] == "attn_logit"]
    if logits:
        d = logits[0].get("detail", {})
        found.append(
            Finding(
                logits[0]["step"],
                "attention logit growth",
                f"max attention logit {d.get('value', float('nan')):.3g} in blocks.{d.get('block')} at step "
                f"{logits[0]['step']} (alarm {d.get('threshold', float('nan')):g})",
                "enable model.qk_norm=true (and/or optim.z_loss=1e-4), or lower optim.lr",
                2,
            )
        )
    ratios = [e for e in events if e["kind"] == "update_ratio"]
    if ratios:
        d = ratios[0].get("detail", {})
        found.append(
            Finding(
                ratios[0]["step"],
                "oversized updates",
                f"update/param ratio {d.get('value', float('nan')):.3g} at step {ratios[0]['step']} "
                f"(alarm {d.get('threshold', float('nan')):g})",
                "lower optim.lr or lengthen optim.warmup_steps",
                2,
            )
        )
    return sorted(found, key=lambda f: f.onset)


def loss_onset(log: RunLog) -> int | None:
    """First logged step where train/loss is non-finite or leaves its best value for good. A rollback or rewind
    resets the best: the loss that rises back to the restored state's level is the reset, not a divergence."""
    steps, loss = log.series("train/loss")
    resets = sorted(step for step, _ in log.restores())
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


def _value_at(log: RunLog, tag: str, step: int) -> float | None:
    steps, values = log.series(tag)
    if len(steps) == 0:
        return None
    i = int(np.searchsorted(steps, step, side="right")) - 1
    return float(values[max(i, 0)])


def _grad_rise(log: RunLog, onset: int) -> tuple[float, float, int] | None:
    """(max grad norm over the LOOKBACK steps up to onset, its rise over the quiet median before, span)."""
    steps, g = log.series("optim/grad_norm")
    ok = np.isfinite(g)
    recent = g[ok & (steps > onset - LOOKBACK) & (steps <= onset)]
    quiet = g[ok & (steps <= onset - LOOKBACK)]
    if len(recent) == 0:
        return None
    base = float(np.median(quiet)) if len(quiet) else float(np.min(recent))
    return float(recent.max()), float(recent.max()) / max(base, 1e-12), min(LOOKBACK, onset - int(steps[0]))


def _curves(log: RunLog, alarms: list[Finding]) -> Finding | None:
    """A loss that diverged, or alarms that say it is about to; the run's settings pick the likely reason."""
    diverged = loss_onset(log)
    if diverged is None and not alarms:
        return None
    onset = min(s for s in (diverged, alarms[0].onset if alarms else None) if s is not None)
    lr = _value_at(log, "optim/lr", onset)
    lrs = log.series("optim/lr")[1]
    peak = float(np.nanmax(lrs)) if len(lrs) else None
    at = (
        (f"at LR {lr:.3g}" + (" (peak)" if peak and lr >= 0.8 * peak else ""))
        if lr is not None
        else "at an unlogged LR"
    )
    rise = _grad_rise(log, onset)
    grew = rise and rise[1] >= 2 and rise[2] > 0
    parts = [
        f"grad norm rose {rise[1]:.0f}x to {rise[0]:.3g} over {rise[2]} steps {at}"
        if grew
        else f"grad norm {rise[0]:.3g} {at}"
        if rise
        else at
    ]
    parts += [a.summary for a in alarms]
    parts.append(f"the loss diverged at step {diverged}" if diverged is not None else "the loss had not diverged yet")
    evidence = "; ".join(parts)
    clip, warmup = log.setting("trainer.gradient_clip_val"), log.setting("optim.warmup_steps")
    known = log.config is not None
    if known and not clip and not warmup:
        return Finding(
            onset,
            "no clipping, no warmup",
            f"{evidence}; no clipping and no warmup",
            "enable clipping (trainer.gradient_clip_val=1.0) and warmup (optim.warmup_steps ~ 1-5% of steps)",
            1,
        )
    if known and not clip:
        return Finding(
            onset,
            "no clipping",
            f"{evidence}; no clipping",
            "enable clipping (trainer.gradient_clip_val=1.0) or lower optim.lr",
            1,
        )
    if any(a.cause == "attention logit growth" for a in alarms):
        return Finding(
            onset,
            "attention logit growth",
            evidence,
            "enable model.qk_norm=true (and/or optim.z_loss=1e-4), or lower optim.lr",
            1,
        )
    return Finding(
        onset,
        "learning rate too high",
        evidence,
        "lower optim.lr (e.g. 3x), or add model.qk_norm=true / optim.z_loss=1e-4",
        1,
    )


def _lone_update(log: RunLog, events: list[dict]) -> Finding | None:
    """An update-ratio alarm after quiet measurements: one step moved the weights too far (an LR spike)."""
    ratios = [e for e in events if e["kind"] == "update_ratio"]
    if not ratios:
        return None
    first = ratios[0]
    steps, values = log.series("stability/update_ratio")
    threshold = first.get("detail", {}).get("threshold", 1.0)
    quiet = values[(steps < first["step"]) & np.isfinite(values)]
    if len(quiet) == 0 or (quiet > threshold).any():
        return None  # alarms from the first measurement on: the whole recipe is too hot, not one step
    return Finding(
        first["step"],
        "oversized update (LR spike)",
        f"update/param ratio {first['detail'].get('value', float('nan')):.3g} at step {first['step']} after "
        f"{len(quiet)} quiet measurement(s) (max {quiet.max():.2g}): one update moved the weights too far",
        "check the LR the optimizer really used (scheduler state after a resume, a manual LR change); "
        "callbacks.stability.spike.action=rollback undoes such a step",
    )


SIGNAL_NAMES = {
    "residual_rms": "residual-stream growth",
    "update_ratio": "oversized updates at the peak LR",
    "log_z": "output-logit (log Z) drift",
    "attn_logit": "attention logit growth",
}


def precursor_lead(log: RunLog) -> dict | None:
    """The precursor signal that fired first and how far ahead: its forecast step, its first alarm step and the
    step the loss showed the trouble (any may be None)."""
    fired = [e for e in log.events if e["kind"] in ("forecast", "precursor")]
    if not fired:
        return None
    signal = fired[0]["detail"].get("signal")
    mine = [e for e in fired if e["detail"].get("signal") == signal]
    alarm = next((e for e in mine if e["kind"] == "precursor"), None)
    # a forecast counts when it came before the alarm (a later one forecasts a new episode)
    forecast = next(
        (e for e in mine if e["kind"] == "forecast" and (alarm is None or e["step"] <= alarm["step"])), None
    )
    return {
        "signal": signal,
        "forecast": forecast,
        "alarm": alarm,
        "loss_onset": loss_onset(log),
        "peak": max(float(e["detail"]["value"]) for e in mine),
        "threshold": float(mine[0]["detail"]["threshold"]),
    }


def _precursor(log: RunLog, events: list[dict]) -> Finding | None:
    """A precursor signal (signals.py) forecast or past its level: which one, how far ahead, what was done."""
    lead = precursor_lead(log)
    if lead is None or (lead["alarm"] is None and lead["signal"] == "attn_logit"):
        return None  # a logit forecast alone: QK-clip's events tell the rest
    signal, forecast, alarm, onset = lead["signal"], lead["forecast"], lead["alarm"], lead["loss_onset"]
    parts = []
    if forecast is not None:
        d = forecast["detail"]
        parts.append(
            f"forecast at step {forecast['step']} ({d['value']:.3g}, doubling every {d['doubling_steps']:.0f} "
            f"steps, level {d['threshold']:g} expected at step {d['expected_step']})"
        )
        steps, _ = log.series("train/loss")
        if alarm is None and len(steps) and max(steps) <= d.get("by_step", d["expected_step"]):
            parts[-1] += f", still live when the run ended at step {int(max(steps))}"
    if alarm is not None:
        ahead = (
            f", {alarm['step'] - forecast['step']} steps after the forecast" if forecast else " (no forecast before)"
        )
        parts.append(f"past {lead['threshold']:g} at step {alarm['step']}{ahead} (max {lead['peak']:.3g})")
    first = forecast or alarm
    if onset is not None:
        parts.append(f"the loss showed it at step {onset}, {onset - first['step']} steps after the first warning")
    else:
        parts.append("the loss never showed a spike or divergence")
    backoffs = [e for e in events if e["kind"] == "lr_backoff" and e["detail"].get("cause") == signal]
    fix = "lower optim.lr (python -m steadylm.doctor runs the LR probe) or lengthen optim.warmup_steps"
    if backoffs:
        d = backoffs[-1]["detail"]
        parts.append(f"the suite lowered the LR {len(backoffs)} time(s) to x{d['lr_scale']:g}")
        fix = f"set optim.lr x{d['lr_scale']:g} from the start, or lower; python -m steadylm.doctor runs the LR probe"
    # The suite acting on it is first-hand; an alarm alone is a symptom the curves and settings explain.
    rank = 0 if backoffs else 2 if alarm is not None else 3
    return Finding(first["step"], SIGNAL_NAMES.get(signal, signal), f"{signal}: " + "; ".join(parts), fix, rank)


def analyse(log: RunLog) -> Diagnosis:
    events = log.events
    precursor = _precursor(log, events)
    acted = precursor if precursor is not None and precursor.rank == 0 else None
    found = (_nonfinite(events), _fp16(events), _spike(log, events), _lone_update(log, events), acted)
    found += tuple(Finding(**f) for f in described(events, config_checks(log.config)))  # the run's own checks
    firsthand = sorted((f for f in found if f), key=lambda f: f.onset)
    symptom = [precursor] if precursor is not None and precursor.rank == 2 else []
    alarms = sorted(_alarms(events) + symptom, key=lambda f: f.onset)
    curve = _curves(log, [a for a in alarms if not firsthand or a.onset < firsthand[0].onset - EVENT_SLACK])
    if curve and (not firsthand or curve.onset < firsthand[0].onset - EVENT_SLACK):
        ordered = [curve, *firsthand]
    else:
        ordered = firsthand + ([curve] if curve else [])
    if precursor is not None and precursor.rank == 3:  # a forecast that no alarm followed: shown, never the cause
        ordered.append(precursor)
    return Diagnosis(findings=ordered, facts=_facts(log))


def _optimizer(log: RunLog) -> str:
    """adamw, or muon with the knobs that set its step size (a run from before `optim.name` was AdamW)."""
    name = log.setting("optim.name", "adamw")
    if name != "muon":
        return name
    m = log.setting("optim.muon", {})
    return f"muon (adjust_lr={m.get('adjust_lr')}, lr_mult={m.get('lr_mult')}, ns_dtype={m.get('ns_dtype')}; AdamW on the rest)"


def _facts(log: RunLog) -> list[str]:
    lr = log.setting("optim.lr")
    unstable = instability(log.run_dir, float(lr) if lr is not None else None, config_checks(log.config))
    facts = [f"unstable: {unstable}"] if unstable else []  # the line result.json's `reason` gives, from one place
    steps, loss = log.series("train/loss")
    if len(steps):
        finite = loss[np.isfinite(loss)]
        best = f", best {finite.min():.3f}" if len(finite) else ""
        facts.append(
            f"train/loss logged for steps {steps[0]}..{steps[-1]}: first {loss[0]:.3f}, last {loss[-1]:.3f}{best}"
        )
    vsteps, vloss = log.series("val/loss")
    if len(vsteps):
        facts.append(f"val/loss at {len(vsteps)} evaluations, last {vloss[-1]:.3f} at step {vsteps[-1]}")
    by_source = {t[len("val/loss/") :]: log.series(t)[1] for t in sorted(log.scalars) if t.startswith("val/loss/")}
    if by_source:  # data.sources: each source's own val loss beside the weighted one
        facts.append("val/loss by source, last: " + ", ".join(f"{n} {v[-1]:.3f}" for n, v in by_source.items()))
    if log.config is not None:
        facts.append(
            f"config: optim={_optimizer(log)}, optim.lr={log.setting('optim.lr')}, "
            f"optim.warmup_steps={log.setting('optim.warmup_steps')}, "
            f"trainer.gradient_clip_val={log.setting('trainer.gradient_clip_val')}, "
            f"trainer.precision={log.setting('trainer.precision')}"
        )
    rollbacks = [e for e in log.events if e.get("kind") == "rollback"]
    if rollbacks:
        sources = sorted({str(e.get("detail", {}).get("source", "disk")) for e in rollbacks})
        facts.append(
            f"{len(rollbacks)} reset(s) to an earlier state (from {', '.join(sources)}): "
            + "; ".join(
                f"at step {e['step']} back to step {e['detail']['to_step']} "
                f"({e['detail'].get('skipped_data_steps', e['step'] - e['detail']['to_step'])} steps of progress, "
                f"cause {e['detail'].get('cause', '?')})"
                for e in rollbacks
            )
        )
    cut = [e for e in log.events if e.get("kind") == "unrecovered"]
    if cut:
        facts.append(cut_short(cut[-1]["detail"]))
    stops = [e for e in log.events if e.get("action") == "stop" and e.get("detail", {}).get("reason")]
    if stops:
        d = stops[0]["detail"]
        saved = f"; last good state in {d['last_good_checkpoint']}" if d.get("last_good_checkpoint") else ""
        facts.append(f"status: diverged at step {stops[0]['step']}: {d['reason']}{saved}")
    facts.append(
        f"{len(log.events)} stability event(s)"
        + (": " + ", ".join(sorted({e["kind"] for e in log.events})) if log.events else "")
    )
    return facts + log.notes
