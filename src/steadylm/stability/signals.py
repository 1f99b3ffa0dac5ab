"""`Precursors`: instability that the attention logits do not show, flagged, forecast and backed off from.

With QK-norm on, attention logits stay bounded at any LR, so QK-clip never fires; a far too high LR still does its
damage elsewhere. The signals (docs/stability.md) come from the `stats` check's steps, in the step's one collective:
`residual_rms` (a too-high LR grows the weights, and with them the stream, by orders of magnitude), `update_ratio`
(a step the weights cannot absorb), `log_z` (output-logit divergence, Wortsman et al. 2023) and `attn_logit`
(forecast only: QK-clip owns its alarm and its mitigation).

A signal is *alarmed* above its level (null: not judged); alarmed on `persist` stats steps in a row where QK-clip
cannot act, it asks its `Backoff` for a lower LR and a rewind to before the growth began. Before that, once per
episode, a *forecast*: from a log-linear fit of the values read every step (the residual RMS, QK-clip's max logit: no
host read of their own), or of the rising last `trend_points` stats-step values (`log_z`). The levels are far above
healthy values (under Muon, scaled to the model's size: `fit_to`) and the horizon short: in
`benchmarks/divergence_bench.py` the unstable runs doubled every 0.3-3.3 steps at their forecast.
"""

from __future__ import annotations

import math
from collections import deque
from types import SimpleNamespace

from steadylm.errors import ConfigError
from steadylm.stability.backoff import Backoff
from steadylm.stability.check import Check
from steadylm.stability.stats import OWN, UPDATE, stats_metrics
from steadylm.stability.verdict import Verdict

PERSISTENT_PRECURSORS = 5  # `precursor` events (with no backoff) that make a run `unstable`
SIGNAL_CAUSES = {
    "residual_rms": "the residual stream's RMS grew past {level:g} (max {peak:.3g})",
    "update_ratio": "the update/param ratio stayed above {level:g} after the warmup (max {peak:.3g})",
    "log_z": "the output softmax's |log Z| drifted past {level:g} (max {peak:.3g})",
}


def explain(events: list[dict], lr: float | None, cut: str | None) -> str | None:
    """The run's `unstable` line (`stability.instability`) when the signals backed off or alarmed on
    `PERSISTENT_PRECURSORS` steps while the attention logits were quiet (else those name the cause); the first
    signal to fire names it."""
    if any(e.get("kind") == "attn_logit" or (e.get("kind"), e.get("action")) == ("qk_clip", "clip") for e in events):
        return None
    precursors = [e for e in events if e.get("kind") == "precursor"]
    backoffs = [e for e in events if e.get("kind") == "lr_backoff" and e["detail"].get("cause") != "qk_clip"]
    if not backoffs and len(precursors) < PERSISTENT_PRECURSORS:
        return None
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


SIGNAL_NAMES = {
    "residual_rms": "residual-stream growth",
    "update_ratio": "oversized updates at the peak LR",
    "log_z": "output-logit (log Z) drift",
    "attn_logit": "attention logit growth",
}


def describe(events: list[dict], log) -> list[dict]:
    """diagnose's finding: the signal that fired first, its forecast and alarm steps, how far ahead of the loss, and
    what the suite did. Backed off: first-hand (rank 0); an alarm alone: a symptom (2); a forecast alone: shown,
    never the cause (3); a logit forecast alone: QK-clip's events tell the rest."""
    fired = [e for e in events if e["kind"] in ("forecast", "precursor")]
    if not fired:
        return []
    signal = fired[0]["detail"].get("signal")
    mine = [e for e in fired if e["detail"].get("signal") == signal]
    alarm = next((e for e in mine if e["kind"] == "precursor"), None)
    # a forecast counts when it came before the alarm (a later one forecasts a new episode)
    forecast = next(
        (e for e in mine if e["kind"] == "forecast" and (alarm is None or e["step"] <= alarm["step"])), None
    )
    if alarm is None and signal == "attn_logit":
        return []
    parts, onset = [], log.loss_onset()
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
        peak = max(float(e["detail"]["value"]) for e in mine)
        parts.append(f"past {float(mine[0]['detail']['threshold']):g} at step {alarm['step']}{ahead} (max {peak:.3g})")
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
    rank = 0 if backoffs else 2 if alarm is not None else 3
    summary = f"{signal}: " + "; ".join(parts)
    return [
        {
            "onset": first["step"],
            "cause": SIGNAL_NAMES.get(signal, signal),
            "summary": summary,
            "fix": fix,
            "rank": rank,
        }
    ]


SIGNALS = ("residual_rms", "update_ratio", "log_z", "attn_logit")
GROWING = ("residual_rms", "log_z", "attn_logit")  # forecast from their trend; the update ratio is not a trend
AFTER_WARMUP = ("update_ratio",)  # large early in any run: judged from the end of the warmup
STEPWISE = ("residual_rms", "attn_logit")  # also read every step, where that costs no host read
# The fewest steps a per-step trend is fitted over: a 100x LR takes the residual from 0.05 past 100 in 5 steps. The
# window keeps every value from the start, so so few points are only fitted in a run's first steps (or after a
# restart), where a healthy run is far below `forecast_from` of the level.
FIT_POINTS = 4
# The shape the residual level was set at (tiny's: d 128, 2 layers). Muon moves every hidden matrix by the same RMS at
# any size, so its healthy residual grows with width and depth (LR 2e-2: 6.8 / 28 / 56 at d 64 / 256 / 512 with 2
# layers, 23 / 110 at d 64 / 256 with 8); muP keeps AdamW's (1.7 / 1.4 at d 64 / 512, 2 layers; 4.6 at d 256, 8).
LEVEL_SHAPE = 128 * 2


def signal_values(metrics: dict[str, float], qk_norm: bool) -> dict[str, float]:
    """The signals' values from one stats step's metrics (`GradParamStats`); a signal not measured is absent."""
    blocks = [v for k, v in metrics.items() if k.startswith("stability/act_rms/block_")]
    logits = [v for k, v in metrics.items() if k.startswith("stability/max_attn_logit/block_")]
    out = {"residual_rms": max(blocks)} if blocks else {}
    if "stability/update_ratio" in metrics:
        out["update_ratio"] = metrics["stability/update_ratio"]
    if "stability/log_z" in metrics:
        out["log_z"] = abs(metrics["stability/log_z"])
    if logits and not qk_norm:
        out["attn_logit"] = max(logits)
    return out


def _flat(value) -> list[float]:
    """A reduced value (a float, or nested lists of them) as a flat list."""
    return [x for v in value for x in _flat(v)] if isinstance(value, list) else [float(value)]


def _log_linear(points, least: int) -> tuple[float, float] | None:
    """(slope of log(value) per step, R² of that fit) by least squares; None with fewer than `least` points."""
    pts = [(s, math.log(v)) for s, v in points if v > 0]
    if len(pts) < least:
        return None
    n = len(pts)
    ms, mv = sum(s for s, _ in pts) / n, sum(v for _, v in pts) / n
    sxx, syy = sum((s - ms) ** 2 for s, _ in pts), sum((v - mv) ** 2 for _, v in pts)
    if not sxx or not syy:
        return None
    slope = sum((s - ms) * (v - mv) for s, v in pts) / sxx
    return slope, slope * slope * sxx / syy


class Precursors(Check):
    name = "signals"

    def __init__(
        self, residual_rms=100.0, update_ratio=None, log_z=None, attn_logit=100.0, persist=3, action="backoff",
        trend_points=3, horizon=25, forecast_from=0.25, trend_window=32, min_fit=0.9, lr_backoff=0.1, max_backoffs=2,
        rewind=True, rewarm_steps=100, watch=None, forecast_lr=None, max_doubling=4,
    ) -> None:  # fmt: skip
        where = "callbacks.stability.signals"
        if forecast_lr is not None and not 0 < forecast_lr < 1:
            raise ConfigError(f"{where}.forecast_lr={forecast_lr} must be in (0, 1), or null for a forecast that logs")
        self.forecast_lr = forecast_lr
        self.holding: dict | None = None  # a forecast's LR hold under way (`verdict`)
        self.levels = dict(residual_rms=residual_rms, update_ratio=update_ratio, log_z=log_z, attn_logit=attn_logit)
        self.residual_level = residual_rms  # as configured: `fit_to` scales it to the model
        self.watched = {}  # your own signals, `watch: {name: {value: CHECK.KEY, level: X}}`: {name: (check, key)}
        for name, spec in (watch or {}).items():
            value, level = str((spec or {}).get("value", "")), (spec or {}).get("level")
            if name in SIGNALS or value.count(".") != 1 or not isinstance(level, (int, float)) or not level > 0:
                must = "{value: CHECK.KEY, level: X > 0} (a check's measured key) under a name not a built-in signal's"
                raise ConfigError(f"{where}.watch.{name} must be {must}")
            self.watched[name] = tuple(value.split("."))
        self.levels.update({name: float(watch[name]["level"]) for name in self.watched})
        for name, level in self.levels.items():
            if level is not None and not level > 0:
                raise ConfigError(f"{where}.{name}={level} must be > 0, or null to not judge it")
        if action not in ("backoff", "log"):
            raise ConfigError(f"{where}.action={action!r} must be backoff or log")
        if persist < 1 or trend_points < 2 or horizon < 1 or not 0 < forecast_from <= 1:
            raise ConfigError(f"{where}: persist >= 1, trend_points >= 2, horizon >= 1 and forecast_from in (0, 1]")
        if trend_window < 4 or not 0 <= min_fit < 1 or not max_doubling > 0:
            raise ConfigError(f"{where}: trend_window >= 4, min_fit in [0, 1) and max_doubling > 0")
        self.persist, self.action, self.trend_points = int(persist), action, int(trend_points)
        self.horizon, self.forecast_from, self.trend_window = int(horizon), float(forecast_from), int(trend_window)
        self.min_fit, self.min_rate = float(min_fit), math.log(2) / max_doubling  # a fit's least log growth per step
        self.series = {s: deque(maxlen=self.trend_window) for s in (*STEPWISE, *self.watched)}  # per-step values
        self.stepwise: set[str] = set()  # the signals this fit reads every step (their forecast comes from there)
        self.backoff = Backoff(where, lr_backoff, max_backoffs, rewind, rewarm_steps)
        self.history = {s: deque(maxlen=self.trend_points) for s in SIGNALS}  # stats-step values
        names = (*SIGNALS, *self.watched)
        self.streak = {s: 0 for s in names}
        self.onset = {s: -1 for s in names}  # its first step in trouble (an alarm; a forecast: after its fit starts)
        self.forecast = {s: -1 for s in names}  # this episode's forecast's horizon (`by_step`); -1: none given
        self.alarms = 0
        # Set by the owner at the fit's start: QK-clip acts on this model (then it owns the mitigation and the
        # signals only log), and how often the stats measure (None: no stats, so nothing to judge).
        self.qk_clip_acts = False
        self.every_n_steps: int | None = None
        self._net = None

    def applies(self, trainer) -> bool:
        """The model keeps its residual stream's RMS on every forward (one reduction, for `measure`); `fit_to` it."""
        module = trainer.lightning_module
        net = getattr(module, "net", None)
        self._net = net if hasattr(net, "track_residual") and self.levels["residual_rms"] is not None else None
        if self._net is not None:
            self._net.track_residual = True
            self.fit_to(net.cfg.d_model, net.cfg.n_layer, (getattr(module, "optim_cfg", None) or {}).get("name"))
        return True

    def fit_to(self, d_model: int, n_layer: int, optim: str | None) -> None:
        """The residual level for this model: the configured one, x d_model * n_layer past tiny's under Muon."""
        if self.residual_level is not None:
            scale = max(1.0, d_model * n_layer / LEVEL_SHAPE) if optim == "muon" else 1.0
            self.levels["residual_rms"] = self.residual_level * scale

    def measure(self, view) -> dict:
        rms = self._net.residual_rms if self._net is not None else None
        return {} if rms is None else {"residual_rms": ("max", rms)}

    def watch(self, step: int, values: dict[str, float]) -> list[Verdict]:
        """`verdict`'s per-step rule on one step's plain values `{signal: value}`."""
        return self.verdict(SimpleNamespace(step=step), None, values)

    def verdict(self, m, view, values: dict[str, float] | None = None) -> list[Verdict]:
        """Every step, from the values read every step (`values`: `watch`'s, alone): a `forecast` when the log-linear
        fit of the last `trend_window` values explains `min_fit` of their variance (a noisy plateau has a slope too),
        doubles within `max_doubling` steps, its later half too (a climb levelling off is slower), and reaches the level
        within `horizon` steps. After a stats step: `observe` its values. A quiet step calls no helper."""
        step, out, watching = m.step, [], values is not None
        if not watching:  # read at no host read of their own: this check's residual RMS, QK-clip's logits
            qk_norm = bool(view.model_cfg is not None and view.model_cfg.qk_norm)
            mine = m.values.get(self.name, {})
            values = {"residual_rms": mine["residual_rms"]} if "residual_rms" in mine else {}
            head_max = m.values.get("qk_clip", {}).get("head_max")
            if head_max is not None and not qk_norm:
                values["attn_logit"] = max(map(max, head_max))
            for name, (check, key) in self.watched.items():
                got = m.values.get(check, {}).get(key)
                if got is not None:
                    values[name] = float(max(_flat(got)))
        for name, value in values.items():
            level = self.levels[name]
            if level is None or not math.isfinite(value):
                continue
            self.stepwise.add(name)
            self.series[name].append((step, value))
            if name in self.watched and value <= level:
                self.streak[name] = 0  # your own signal: back under its level ends its alarm
            if value < level * self.forecast_from:
                if self.streak[name] == 0 and step > self.forecast[name]:  # not while a forecast's horizon is live
                    self.forecast[name], self.onset[name] = -1, -1  # the episode is over
                continue
            if value > level and name in self.watched:  # your own signal's alarm: logged once per episode
                if self.streak[name] == 0:
                    self.streak[name], self.alarms = 1, self.alarms + 1
                    detail = {"signal": name, "value": value, "threshold": level, "streak": 1}
                    out.append(Verdict("log", "precursor", detail, onset=step))
                continue
            if self.forecast[name] >= 0 or value > level:
                continue
            series = list(self.series[name])  # and its later half: a climb levelling off is slower there
            fit, late = _log_linear(series, FIT_POINTS), _log_linear(series[len(series) // 2 :], 2)
            if fit and late and min(fit[0], late[0]) >= self.min_rate and fit[1] >= self.min_fit:
                out += self._forecasting(name, step, value, level, fit[0], series[0][0])
        if watching:
            return out
        h = self.holding  # a forecast's hold ends when its horizon passed with nothing (while the alarm it forecast
        # is under way it holds on), or when a backoff, which lowers the LR for good, came
        if h is not None and (h.get("superseded") or (step > h["until"] and self.streak[h["signal"]] == 0)):
            self.holding = None
            detail = {"signal": h["signal"], "until": h["until"], "factor": 1 / h["factor"], "released": True}
            context = {"temporary": True, "factor": 1 / h["factor"], "unpin": True}
            out.insert(0, Verdict("log", "forecast_hold", detail, onset=step, context=context))
        stats = m.values.get("stats") or {}
        for at, keys in ((step - 1, UPDATE), (step, OWN)):  # the update of the stats step before `m.step`; its own
            if keys[0] not in stats:
                continue
            signals = signal_values(stats_metrics({k: stats[k] for k in keys}), qk_norm)
            # the LR still ramping up at `at`: the first warmup, or a re-warmup after a rewind
            applied, (start, length) = view.module.applied_steps(at), getattr(view.module, "rewarm", (0, 0))
            warmup = int(getattr(view.module, "optim_cfg", {}).get("warmup_steps", 0))
            in_warmup = applied < warmup or (length > 0 and applied < start + length)
            for v in self.observe(at, signals, in_warmup, may_back_off=not self.qk_clip_acts):
                request = v.context.get("backoff")
                if request is not None:
                    keep = ("lr_backoff", "lr_scale", "backoffs", "onset", "rewind_before", "signal", "value")
                    sig = request["signal"]
                    why = f"{sig} stayed above {request['threshold']:g} on {self.persist} measurements in a row"
                    context = {"backoff": {k: request[k] for k in keep if k in request}, "policy": self.backoff}
                    context.update(cause=sig, why=why)
                    v = Verdict("backoff", v.kind, v.detail, onset=v.onset, context=context)
                out.append(v)
        # `forecast_lr`: a forecast acts before the loss turns, one at a time. The snapshot from before the growth is
        # pinned (an alarm's rewind then finds it) and the LR scale lowered until the forecast's horizon passes: one
        # that did not come true lowers no LR for good. `action: log` never acts.
        acts = self.forecast_lr is not None and self.action == "backoff" and self.holding is None
        first = next((v for v in out if v.kind == "forecast"), None)
        if not acts or first is None or any(v.action == "backoff" for v in out):
            return out
        d = first.detail
        self.holding = {"until": d["by_step"], "factor": self.forecast_lr, "signal": d["signal"]}
        pin = self.onset[d["signal"]] - 1  # the snapshot a backoff's rewind would restore: from before the growth
        detail = {**self.holding, "value": d["value"], "expected_step": d["expected_step"], "pinned_before": pin}
        context = {"temporary": True, "factor": self.forecast_lr, "pin_before": pin}
        return [*out, Verdict("backoff", "forecast_hold", detail, onset=first.onset, context=context)]

    def _forecasting(self, name: str, step: int, value: float, level: float, rate: float, since: int) -> list:
        """The `forecast` of a signal growing at `rate` (log per step) since step `since`, when it reaches `level`
        within the horizon (`by_step`: past it, the forecast was false); [] when not."""
        expected = step + math.log(level / value) / rate
        if expected - step > self.horizon:
            return []
        self.forecast[name] = step + self.horizon
        if self.onset[name] < 0:
            self.onset[name] = since + 1  # the growth was under way after the fit's first point
        detail = {"signal": name, "value": value, "threshold": level, "doubling_steps": math.log(2) / rate}
        detail.update(expected_step=int(round(expected)), by_step=step + self.horizon)
        metrics = {f"stability/forecast/{name}": float(detail["expected_step"])}  # TensorBoard's view of it
        return [Verdict("log", "forecast", detail, onset=step, metrics=metrics)]

    def streak_steps(self) -> int:
        """Steps an alarm streak takes to ask for a backoff (0: never judged, no stats)."""
        return self.persist * self.every_n_steps if self.every_n_steps else 0

    def observe(self, step: int, values: dict[str, float], in_warmup: bool, may_back_off: bool = True) -> list[Verdict]:
        """One stats step's values (all-reduced): the `forecast` and `precursor` verdicts, and at most one backoff
        request (in a `precursor` verdict's `context["backoff"]`); none when not `may_back_off` (QK-clip owns the
        mitigation of a model without QK-norm)."""
        out: list[Verdict] = []
        asked = False
        for name in SIGNALS:
            level, value = self.levels[name], values.get(name)
            if level is None or value is None or not math.isfinite(value) or (name in AFTER_WARMUP and in_warmup):
                continue
            self.history[name].append((step, value))
            low = value < level * self.forecast_from
            if low and self.streak[name] == 0 and step > self.forecast[name]:
                self.forecast[name], self.onset[name] = -1, -1  # the episode is over
            if value <= level:
                self.streak[name] = 0
                # a signal not read every step is forecast from its last `trend_points`, each above the one before
                if name in GROWING and name not in self.stepwise and self.forecast[name] < 0 and not low:
                    points = [(s, math.log(v)) for s, v in self.history[name] if v > 0]
                    if len(points) >= self.trend_points and all(b[1] > a[1] for a, b in zip(points, points[1:])):
                        fit = _log_linear(self.history[name], 2)
                        if fit is not None and fit[0] > 0:
                            out += self._forecasting(name, step, value, level, fit[0], self.history[name][0][0])
                continue
            if name == "attn_logit":
                continue  # QK-clip's alarm, not this class's
            self.streak[name] += 1
            self.alarms += 1
            self.onset[name] = step if self.onset[name] < 0 else self.onset[name]
            detail = {"signal": name, "value": value, "threshold": level, "streak": self.streak[name]}
            context = {}
            if self.streak[name] >= self.persist and self.action == "backoff" and may_back_off and not asked:
                request = self.backoff.ask(self.onset[name])
                if request is not None:
                    asked = True
                    context["backoff"] = {**request, "signal": name, "value": value, "threshold": level}
            out.append(Verdict("log", "precursor", detail, onset=step, context=context))
        return out

    def restart(self) -> None:
        """After a backoff (this check's or QK-clip's) the LR, the weights and so the trends start again."""
        if self.holding is not None:
            self.holding["superseded"] = True  # the backoff's LR now rules: the hold ends at the next verdict
        for name in SIGNALS:
            self.history[name].clear()
            self.streak[name], self.onset[name], self.forecast[name] = 0, -1, -1
        for series in self.series.values():
            series.clear()

    def state_dict(self) -> dict:
        lists = lambda d: {k: [list(p) for p in v] for k, v in d.items()}  # plain types: JSON-safe
        state = {"history": lists(self.history), "series": lists(self.series), "streak": dict(self.streak)}
        state.update(onset=dict(self.onset), forecast=dict(self.forecast), alarms=self.alarms, holding=self.holding)
        return {**state, **self.backoff.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for name in self.history:
            self.history[name] = deque(map(tuple, state["history"].get(name, [])), maxlen=self.trend_points)
        for name in self.streak:
            self.streak[name] = int(state["streak"].get(name, 0))
            self.onset[name] = int(state["onset"].get(name, -1))
            self.forecast[name] = int(state["forecast"].get(name, -1))
        for name in self.series:
            self.series[name] = deque(map(tuple, state.get("series", {}).get(name, [])), maxlen=self.trend_window)
        self.alarms = int(state["alarms"])
        self.holding = state.get("holding")
        self.backoff.load_state_dict(state)
