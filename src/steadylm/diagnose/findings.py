"""From a run's log to its diagnosis: the onset step of a divergence and the most likely cause.

Stability events are first-hand evidence (the callback saw the non-finite module, the spike, the
skipped fp16 steps), so each check names the cause of its own events (`stability.instability`). The curves are the fallback, and
also catch what no event describes: a loss that leaves its best value for good, with the grad norm,
the LR and the run's clipping/warmup settings at that step telling the likely reason. When several
explanations exist the earliest onset wins, because what comes after is usually its consequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from steadylm.diagnose.runlog import RunLog
from steadylm.stability.instability import config_checks, cut_short, described, instability

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
    diverged = log.loss_onset()
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


def analyse(log: RunLog) -> Diagnosis:
    """Every check's findings (`stability.instability.described`), ranked: first-hand events by onset, with the
    curves' reading first where the loss showed trouble well before any event; a forecast no alarm followed last."""
    found = [Finding(**f) for f in described(log.events, log, config_checks(log.config))]
    found.sort(key=lambda f: f.onset)
    firsthand = [f for f in found if f.rank == 0]
    alarms = [f for f in found if f.rank == 2]
    curve = _curves(log, [a for a in alarms if not firsthand or a.onset < firsthand[0].onset - EVENT_SLACK])
    if curve and (not firsthand or curve.onset < firsthand[0].onset - EVENT_SLACK):
        ordered = [curve, *firsthand]
    else:
        ordered = firsthand + ([curve] if curve else [])
    return Diagnosis(findings=ordered + [f for f in found if f.rank == 3], facts=_facts(log))


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
