"""`SpikeDetector`: a loss spike that persists asks for a rollback; a one-off is logged; a grad-norm spike is counted.

Robust, so healthy runs raise nothing at any batch size or depth: each value in log space against the median of the
last `window` accepted ones, in units of 1.4826·MAD (one wild value cannot inflate it) at least `noise_floor /
sqrt(sequences per step)`. A grad-norm spike alone is only counted: clipping bounds its update.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections import deque
from itertools import repeat

import numpy as np

from steadylm.errors import ConfigError
from steadylm.stability.check import Check, StepView
from steadylm.stability.events import actions_done
from steadylm.stability.verdict import OK, Verdict

ACTIONS = ("log", "skip", "rollback")
SIGNALS = ("loss", "grad_norm")
MAD_TO_STD = 1.4826
NEAR = 3  # steps before a spike in which an update-ratio alarm is its cause
LR_SPIKE = "oversized update (LR spike)"
LR_CHECK = "check the LR the optimizer really used (scheduler state after a resume, a manual LR change); "


def _recovered(log, step: int) -> bool:
    """Did train/loss come back to its pre-spike level within a few logged points?"""
    steps, loss = log.series("train/loss")
    before, after = loss[(steps < step) & np.isfinite(loss)], loss[steps > step][:5]
    if len(before) == 0 or len(after) == 0:
        return True
    return bool(np.isfinite(after).all() and np.median(after) <= np.min(before[-10:]) + 0.5)


def _worst(log, step: int) -> str:
    """The spike's worst window from `stability/suspects.jsonl`, where it was written."""
    top = next((r for r in log.suspects if r.get("step") == step), None)
    if top is None:
        return ""
    source = f"source {top['source']}, " if top.get("source") else ""  # data.sources
    where = f"{source}{top.get('shard')} tokens {top.get('start')}:{top.get('end')}"
    return f"; worst sample: window {top.get('window')} ({where}, loss {top.get('loss')})"


def describe(events: list[dict], log) -> list[dict]:
    """diagnose's finding for the first loss spike: its cause as the detector judged it (`update`: an update-ratio
    alarm just before names the step; `data`: the windows and the worst sample), else from whether it recovered."""
    hits = [e for e in events if e["kind"] == "loss_spike"]
    if not hits:
        return []
    s, d, acted = hits[0]["step"], hits[0]["detail"], actions_done(hits)
    value = f"loss {d.get('value', float('nan')):.3g} > {d.get('threshold', float('nan')):.3g}"
    big = [e for e in events if e["kind"] == "update_ratio" and s - NEAR <= e["step"] <= s]
    ratio = (
        f"update/param ratio {big[0]['detail'].get('value', float('nan')):.3g} at step {big[0]['step']}, "
        if big
        else ""
    )
    onset = big[0]["step"] if big else s - 1
    cause, evidence = d.get("cause"), d.get("evidence")
    rolled = [e for e in events if e["kind"] == "rollback" and e["detail"].get("onset") == s]
    after = (
        f"; rolled back to step {rolled[0]['detail'].get('to_step')} ({rolled[0]['detail'].get('source')})"
        if rolled
        else ""
    )
    windows = d.get("batch")
    on = f" on data window(s) {windows}" if windows else ""
    if cause == "update":
        summary = f"{ratio}then {value} at step {s}, persisting; {evidence}{after} ({acted})"
        found = (onset, LR_SPIKE, summary, LR_CHECK + "lower optim.lr if it recurs")
    elif cause == "data":
        found = (
            s,
            "bad data batch",
            f"{value} at step {s}{on}, {acted}; {evidence}{after}{_worst(log, s)}",
            "inspect the top rows of stability/suspects.jsonl (`python -m steadylm.diagnose.window "
            "shard=... start=... end=... data.dir=...`) and clean or drop them from the corpus",
        )
    elif cause == "inconclusive":
        found = (
            s,
            "loss spike (cause inconclusive)",
            f"{value} at step {s}, {acted}; {evidence}{after}{_worst(log, s)}",
            "read stability/suspects.jsonl and the update/param ratio around that step",
        )
    elif big or not _recovered(log, s):
        summary = f"{ratio}then {value} at step {s} and the loss did not recover: one update moved the weights too far ({acted})"
        found = (
            onset,
            LR_SPIKE,
            summary,
            LR_CHECK + "lower optim.lr; callbacks.stability.spike.action=rollback undoes such a step",
        )
    else:
        found = (
            s,
            "bad data batch",
            f"{value} at step {s}{on}, {acted}; the loss recovered at once",
            "inspect those windows in the shards; callbacks.stability.spike.action=skip (or rollback) keeps them out of the weights",
        )
    return [dict(zip(("onset", "cause", "summary", "fix"), found))]


class SpikeDetector(Check):
    name = "spike"

    def __init__(
        self, sigma=6.0, window=128, warmup=32, action="rollback", signals=SIGNALS, patience=4, noise_floor=0.1,
        grad_ratio=4.0,
    ) -> None:  # fmt: skip
        key = "callbacks.stability.spike"
        if action not in ACTIONS:
            raise ConfigError(f"{key}.action={action!r} is not one of {', '.join(ACTIONS)}")
        if unknown := set(signals) - set(SIGNALS):
            raise ConfigError(f"{key}.signals has unknown {sorted(unknown)}; use any of {list(SIGNALS)}")
        if not 1 <= warmup <= window:
            raise ConfigError(f"{key}.warmup={warmup} must be between 1 and {key}.window={window}")
        if patience < 1:
            raise ConfigError(f"{key}.patience={patience} must be >= 1")
        self.sigma, self.window, self.warmup, self.action = float(sigma), int(window), int(warmup), action
        # `action: skip` skips the spiking step itself: its value must be read at the step (no deferral).
        self.acts_before_update = action == "skip"
        self.patience, self.noise_floor, self.grad_ratio = int(patience), float(noise_floor), float(grad_ratio)
        self.stats = {s: deque(maxlen=self.window) for s in signals}  # log values, by signal
        self.episode: dict | None = None  # the loss spike under way: onset step, values, the onset batch
        self.sequences = 1  # per optimizer step, all ranks (sets the noise floor)
        self.grad_spikes = 0  # grad-norm spikes the loss did not confirm (`stability/grad_spikes`)

    def window_state(self) -> dict:
        return {s: list(st) for s, st in self.stats.items()}

    def load_window_state(self, state: dict) -> None:
        self.stats = {s: deque(state.get(s, ()), maxlen=self.window) for s in self.stats}

    def verdict(self, m, view: StepView) -> Verdict:
        if m.loss_nonfinite or m.grad_nonfinite:
            return OK
        if m.batches:
            sequences = 0
            for b in m.batches:
                sequences += int(b[0].shape[0])
            self.sequences = max(1, sequences * view.world_size)
        loss_bar = grad_bar = None  # the value above which each signal spikes now (None: not armed)
        for signal, stats in self.stats.items():
            if len(stats) >= self.warmup:
                # `statistics` rather than numpy: 22 against 76 us on 128 values
                med = statistics.median(stats)
                scale = MAD_TO_STD * statistics.median(map(abs, map(operator.sub, stats, repeat(med))))
                if signal == "loss":
                    loss_bar = math.exp(med + self.sigma * max(scale, self.noise_floor / math.sqrt(self.sequences)))
                else:
                    grad_bar = math.exp(med + max(self.sigma * scale, math.log(self.grad_ratio)))
        high = loss_bar is not None and m.loss > loss_bar
        verdict, ep = OK, self.episode
        if ep is not None:
            if high:
                return self._continue(m)
            self.episode = None  # back under the bar at `m.step`: a one-off; the owner adds the ranked samples
            if not ep.get("reported"):
                n, back = len(ep["values"]), f"back under it at step {m.step}"
                why = f"one step above the bar, {back} with the same weights: the batch was unusual, not the model"
                if n > 1:
                    why = f"{n} steps above the bar, {back}: a bad batch or a transient"
                cause = "data" if n == 1 else "inconclusive"
                detail = {**self.detail(ep), "cause": cause, "evidence": why, "recovered_at": m.step}
                verdict = Verdict("log", "loss_spike", detail, onset=ep["onset"], context={"episode": ep, "rank": True})
        if high:
            self.episode = {"onset": m.step, "bar": loss_bar, "values": [], "grad_norm": m.grad_norm,
                            "grad_bar": grad_bar, "batches": m.batches, "batch_idx": m.batch_idx}  # fmt: skip
            return self._continue(m)
        if grad_bar is not None and m.grad_norm > grad_bar:
            self.grad_spikes += 1  # clipping bounds the update and the loss did not confirm it: counted only
        elif "grad_norm" in self.stats and m.grad_norm > 0:
            self.stats["grad_norm"].append(math.log(m.grad_norm))
        if "loss" in self.stats and m.loss > 0:
            self.stats["loss"].append(math.log(m.loss))
        return verdict

    def _continue(self, m) -> Verdict:
        """One more step of the episode above the bar (its first opens it); `patience` of them: it persisted."""
        ep = self.episode
        ep["values"].append(m.loss)
        if ep.get("reported"):
            return Verdict(suspect=True)  # `action: log`: reported once, watched until the loss is back
        if len(ep["values"]) < self.patience:
            return Verdict("skip" if self.action == "skip" else "ok", suspect=True)
        if self.action == "log":
            ep["reported"] = True
            why = f"above the bar for {len(ep['values'])} steps; not rolled back (callbacks.stability.spike.action=log)"
            return self._inconclusive(ep, why, persisting=True)
        self.episode = None
        reason = f"loss spike at step {ep['onset']} persisted for {len(ep['values'])} steps"
        detail = {**self.detail(ep), "persisting": True}
        return Verdict("rollback", "loss_spike", detail, onset=ep["onset"], reason=reason, suspect=True,
                       context={"episode": ep})  # fmt: skip

    def detail(self, ep: dict) -> dict:
        detail = {"value": ep["values"][0], "threshold": ep["bar"], "sigma": self.sigma, "grad_norm": ep["grad_norm"]}
        grad_spike = ep["grad_bar"] is not None and ep["grad_norm"] > ep["grad_bar"]
        return {**detail, "grad_spike": grad_spike, "steps_above": len(ep["values"]), "peak": max(ep["values"])}

    def finish(self) -> Verdict:
        """Training ended inside an episode not yet reported: report it."""
        ep, self.episode = self.episode, None
        if ep is None or ep.get("reported"):
            return OK
        return self._inconclusive(ep, "training ended before the loss came back")

    def _inconclusive(self, ep: dict, evidence: str, **extra) -> Verdict:
        detail = {**self.detail(ep), "cause": "inconclusive", **extra, "evidence": evidence}
        return Verdict("log", "loss_spike", detail, onset=ep["onset"], suspect=True, context={"episode": ep})

    def state_dict(self) -> dict:
        return {"values": self.window_state(), "sequences": self.sequences, "grad_spikes": self.grad_spikes}

    def load_state_dict(self, state: dict) -> None:
        self.load_window_state(state.get("values", {}))
        self.sequences = int(state.get("sequences", 1))
        self.grad_spikes = int(state.get("grad_spikes", 0))
