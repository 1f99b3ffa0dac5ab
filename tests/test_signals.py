"""Precursor signals (`stability/signals.py`): the verdicts on synthetic series (forecast before the alarm, a
bounded backoff once the alarm persists, nothing on a healthy series), resume, the `unstable` reason, and one
real too-high-LR run with QK-norm that the attention logits cannot flag."""

from __future__ import annotations

import json
import math

import pytest

from steadylm.errors import ConfigError
from steadylm.result import finish_job
from steadylm.stability import read_events
from steadylm.stability.instability import instability
from steadylm.stability.signals import Precursors, _log_linear, signal_values
from steadylm.train import train
from tests.helpers import scalars


def growing(start: float, doubling: float, steps=range(0, 200, 10)) -> list[tuple[int, float]]:
    return [(s, start * 2 ** (s / doubling)) for s in steps]


def feed(check: Precursors, series, name="residual_rms", warmup=0):
    """The verdicts on `series`; a backoff restarts the check, as the owner (`backoff.act`) does."""
    out = []
    for step, value in series:
        verdicts = check.observe(step, {name: value}, in_warmup=step < warmup)
        out += [(step, v) for v in verdicts]
        if any("backoff" in v.context for v in verdicts):
            check.restart()
    return out


def test_a_growing_residual_is_forecast_then_flagged_then_backed_off_once_per_budget():
    check = Precursors(persist=3, max_backoffs=1)
    verdicts = feed(check, growing(1.0, 10.0))  # 1 -> 100 at step ~66
    kinds = [(s, v.kind) for s, v in verdicts]
    forecasts = [(s, v) for s, v in verdicts if v.kind == "forecast"]
    alarms = [(s, v) for s, v in verdicts if v.kind == "precursor"]
    assert len(forecasts) == 1 and forecasts[0][0] == 50, kinds  # 32 >= 25, rising at each of 3 points
    detail = forecasts[0][1].detail
    assert detail["signal"] == "residual_rms" and detail["doubling_steps"] == pytest.approx(10.0)
    assert detail["expected_step"] == 66 and detail["by_step"] == 75  # 50 + log2(100 / 32) * 10; 50 + horizon
    assert alarms[0][0] == 70 and alarms[0][1].detail["threshold"] == 100.0
    backoffs = [(s, v.context["backoff"]) for s, v in alarms if "backoff" in v.context]
    assert [s for s, _ in backoffs] == [90]  # the third alarm in a row; the budget of 1 is spent after it
    request = backoffs[0][1]
    assert request["lr_scale"] == pytest.approx(0.1) and request["signal"] == "residual_rms"
    assert request["rewind_before"] == 30  # the forecast's first point (step 30) or before: the snapshot it pinned
    assert check.backoff.backoffs == 1 and len(alarms) > 3  # alarms go on being logged after the budget


def test_a_healthy_series_raises_nothing_and_a_log_policy_never_backs_off():
    noisy = [(s, 1.0 + 0.5 * math.sin(s)) for s in range(0, 400, 10)]
    assert feed(Precursors(update_ratio=0.03, log_z=10.0), noisy) == []
    plateau = [(s, 30.0 + 3 * math.sin(s)) for s in range(0, 400, 10)]  # near the level, no steady rise
    assert feed(Precursors(), plateau, name="attn_logit") == []
    logging_only = Precursors(action="log", persist=1)
    verdicts = feed(logging_only, growing(50.0, 10.0))
    assert verdicts and not any(v.context.get("backoff") for _, v in verdicts)


def test_the_update_ratio_is_judged_only_after_the_warmup_and_attn_logits_are_only_forecast():
    check = Precursors(residual_rms=None, update_ratio=0.03, persist=2)
    early = feed(check, [(s, 0.5) for s in range(0, 50, 10)], name="update_ratio", warmup=50)
    assert early == []
    late = feed(check, [(s, 0.5) for s in range(50, 80, 10)], name="update_ratio", warmup=50)
    assert [v.kind for _, v in late] == ["precursor"] * 3 and "backoff" in late[1][1].context
    logits = feed(Precursors(), growing(5.0, 20.0), name="attn_logit")
    assert {v.kind for _, v in logits} == {"forecast"}  # QK-clip owns the alarm and the mitigation


def test_state_survives_a_resume_mid_episode():
    series = growing(1.0, 10.0)
    whole = Precursors()
    expected = feed(whole, series)
    first = Precursors()
    head = feed(first, series[:6])
    resumed = Precursors()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    tail = feed(resumed, series[6:])
    assert [(s, v.kind, v.detail) for s, v in head + tail] == [(s, v.kind, v.detail) for s, v in expected]
    assert resumed.state_dict() == whole.state_dict()


def test_bad_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match="signals.residual_rms=-1"):
        Precursors(residual_rms=-1)
    with pytest.raises(ConfigError, match="signals.action='stop'"):
        Precursors(action="stop")
    with pytest.raises(ConfigError, match="signals.lr_backoff=2"):
        Precursors(lr_backoff=2)


def test_signal_values_come_from_the_stats_metrics():
    metrics = {
        "stability/act_rms/block_0": 3.0,
        "stability/act_rms/block_1": 7.0,
        "stability/update_ratio": 0.01,
        "stability/log_z": -12.0,
        "stability/max_attn_logit/block_0": 40.0,
    }
    assert signal_values(metrics, qk_norm=False) == {
        "residual_rms": 7.0,
        "update_ratio": 0.01,
        "log_z": 12.0,
        "attn_logit": 40.0,
    }
    assert "attn_logit" not in signal_values(metrics, qk_norm=True)


def _events(tmp_path, events):
    (tmp_path / "stability").mkdir(parents=True)
    (tmp_path / "stability" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return tmp_path


def test_an_unmitigated_persisting_signal_makes_the_run_unstable_with_cause_and_fix(tmp_path):
    alarm = {
        "kind": "precursor",
        "action": "log",
        "detail": {"signal": "update_ratio", "value": 0.2, "threshold": 0.03},
    }
    run = _events(tmp_path, [{**alarm, "step": s} for s in (100, 110, 120, 130, 140)])
    reason = instability(run, lr=0.3)
    assert reason.startswith("the update/param ratio stayed above 0.03 after the warmup (max 0.2) from step 100")
    assert "on 5 stats steps, unmitigated" in reason and "fix: optim.lr=0.03" in reason
    assert instability(_events(tmp_path / "few", [{**alarm, "step": 100}])) is None


@pytest.mark.slow
def test_a_too_high_lr_with_qk_norm_is_flagged_backed_off_and_ends_unstable(make_cfg, tmp_path):
    """lr 0.3 with QK-norm: the attention logits stay bounded, the residual stream does not."""
    cfg = make_cfg("model.qk_norm=true", "optim.lr=0.3", "trainer.max_steps=25", "data.val_windows=8")
    train(cfg)
    events = read_events(tmp_path / "run")
    kinds = [e["kind"] for e in events]
    assert "qk_clip" not in kinds and "attn_logit" not in kinds  # nothing the logits could have said
    alarms = [e for e in events if e["kind"] == "precursor"]
    assert alarms and alarms[0]["detail"]["signal"] == "residual_rms" and alarms[0]["detail"]["value"] > 100
    (backoff,) = [e for e in events if e["kind"] == "lr_backoff"][:1]
    assert backoff["detail"]["cause"] == "residual_rms" and backoff["detail"]["lr_scale"] == pytest.approx(0.1)
    assert "rollback" in kinds and backoff["detail"]["rewound_to"] == 0
    finish_job(cfg, {"train/loss": 3.0, "val/loss": 3.0})
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "unstable" and "residual stream's RMS grew past 100" in result["reason"]
    assert "fix: optim.lr=0.03" in result["reason"]


def test_where_qk_clip_acts_the_signals_only_log():
    check = Precursors(persist=1)
    verdicts = [v for s, x in growing(200.0, 10.0)[:3] for v in check.observe(s, {"residual_rms": x}, False, False)]
    assert [v.kind for v in verdicts] == ["precursor"] * 3 and not any(v.context for v in verdicts)
    assert check.backoff.backoffs == 0


def test_a_signal_read_every_step_is_forecast_from_its_fit_within_its_horizon():
    """Per-step values (`watch`): exponential growth is forecast once, with the step it expects the level at and
    the horizon past which the forecast was false; a noisy plateau near the level and a slow healthy climb are not.
    A signal read every step is no longer forecast from the stats steps."""
    check = Precursors()
    blowup = [(s, 2.0 * 2 ** (s / 3)) for s in range(20)]  # doubling every 3 steps, past 100 at step 17
    verdicts = [(s, v) for s, x in blowup for v in check.watch(s, {"residual_rms": x})]
    ((step, v),) = verdicts
    assert step < 17 and v.kind == "forecast" and v.detail["expected_step"] == 17
    assert v.detail["doubling_steps"] == pytest.approx(3.0) and v.detail["by_step"] == step + check.horizon
    assert check.observe(20, {"residual_rms": 30.0}, in_warmup=False) == []  # its forecast came from `watch`
    noisy = Precursors()
    plateau = [(s, 40.0 * (1.25 if s % 2 else 0.8)) for s in range(100)]
    assert [v for s, x in plateau for v in noisy.watch(s, {"residual_rms": x})] == []
    slow = Precursors()
    climb = [(s, 20.0 + 0.05 * s) for s in range(400)]  # 20 -> 40 in 400 steps: the level is 1,500+ steps away
    assert [v for s, x in climb for v in slow.watch(s, {"attn_logit": x})] == []
    fast = Precursors()  # the residual RMS of the 100x-LR QK-norm run (divergence_bench), steps 0-5: 100 at step 5
    steep = enumerate([0.0509, 0.6357, 11.43, 42.66, 99.57, 185.0])
    ((step, v),) = [(s, v) for s, x in steep for v in fast.watch(s, {"residual_rms": x})]
    assert (step, v.detail["expected_step"]) == (3, 3)


def test_a_dip_under_the_forecast_floor_within_the_horizon_does_not_forecast_again():
    """One forecast per episode: a noisy signal that dips under `forecast_from` of its level and climbs again while
    its forecast's horizon is live is the same episode (model=small under Muon: 27, then 24, then 31)."""
    check = Precursors()
    rise = [(s, 10.0 * 2 ** (s / 3)) for s in range(5)]  # 25.2 at step 4: forecast
    bounce = [(5, 24.0), (6, 40.0), (7, 20.0), (8, 45.0)]
    got = [(s, v.kind) for s, x in rise + bounce for v in check.watch(s, {"attn_logit": x})]
    assert got == [(4, "forecast")]


def test_a_climb_levelling_off_is_not_forecast_however_well_it_fits():
    """`max_doubling`: the residual RMS of the fast preset (Muon) at 2x its LR, steps 14-45, a healthy run that
    peaks at 75. Its 32-step fit explains 94 % of the variance and reaches 100 by step 58, but doubles every 6.6
    steps: not forecast. With no cap on the doubling time it is (the false forecast this rule removes)."""
    climb = [0.9, 1.0, 1.2, 1.5, 1.9, 2.3, 2.8, 3.5, 4.1, 4.4, 5.9, 6.2, 6.7, 7.6, 8.5, 9.3, 10.4, 10.7, 12.5, 12.8]
    climb += [13.7, 14.9, 15.2, 16.5, 17.7, 18.5, 18.8, 20.3, 22.3, 24.2, 24.6, 25.3]
    series = list(enumerate(climb, start=14))
    capped, uncapped = Precursors(), Precursors(max_doubling=1e9)
    assert [v for s, x in series for v in capped.watch(s, {"residual_rms": x})] == []
    (forecast,) = [v for s, x in series for v in uncapped.watch(s, {"residual_rms": x})]
    assert forecast.detail["doubling_steps"] == pytest.approx(6.6, abs=0.2) and forecast.detail["expected_step"] < 60


def test_a_steep_start_does_not_carry_a_fit_whose_later_half_slowed():
    """The residual RMS of divergence_bench's embeddings N(0, 1), untied head, lr 10x, steps 0-39 (read every step): it
    rose 10x in 6 steps, then slowed and levelled off at ~35, and the run ended `ok`, its val below its twin's. The
    fit of steps 0-16 doubles every 3.3 steps, its later half every 5.9: not forecast. Judged on the whole fit alone,
    it was, at step 16 (25.3 -> 100 by step 23), a forecast whose horizon passed with nothing."""
    rise = [1.51, 1.51, 1.55, 1.67, 1.94, 2.78, 4.2, 6.16, 8.63, 11.16, 13.41, 16.18, 18.14, 17.9, 18.47, 21.81]
    rise += [25.34, 27.42, 29.39, 31.43, 32.88, 35.03, 33.69, 33.71, 35.21, 36.09, 36.62, 34.92, 32.75, 31.69]
    rise += [31.87, 33.28, 35.7, 35.63, 36.36, 37.45, 36.23, 33.37, 32.31, 32.3]
    check = Precursors()
    assert [v for s, x in enumerate(rise) for v in check.watch(s, {"residual_rms": x})] == []
    fit, late = (_log_linear(list(enumerate(part)), 2) for part in (rise[:17], rise[8:17]))
    assert math.log(2) / fit[0] < math.log(2) / check.min_rate < math.log(2) / late[0]


def test_under_muon_the_residual_level_follows_the_models_size(make_cfg):
    """A healthy Muon run's residual RMS grows with the width and the depth (110 at d 256 with 8 layers, LR 2e-2;
    `signals.LEVEL_SHAPE`), AdamW's under muP does not: under optim=muon the level is the configured one x
    d_model * n_layer / 256, never lower, set at the fit's start from the module's model and optimizer."""
    from types import SimpleNamespace

    from steadylm.module import LMModule

    check = Precursors()
    for shape, optim, level in (((256, 8), "muon", 800.0), ((64, 2), "muon", 100.0), ((768, 12), "adamw", 100.0)):
        check.fit_to(*shape, optim)
        assert check.levels["residual_rms"] == level
    cfg = make_cfg("optim=muon", "model.d_model=256", "model.n_head=8", "model.n_layer=4")
    assert check.applies(SimpleNamespace(lightning_module=LMModule(model=cfg.model, optim=cfg.optim)))
    assert check.levels["residual_rms"] == 400.0
    assert check.observe(50, {"residual_rms": 110.0}, in_warmup=False) == []
    ((alarm,),) = [Precursors().observe(50, {"residual_rms": 110.0}, in_warmup=False)]
    assert (alarm.kind, alarm.detail["threshold"]) == ("precursor", 100.0)
    unjudged = Precursors(residual_rms=None)
    unjudged.fit_to(256, 8, "muon")
    assert unjudged.levels["residual_rms"] is None


def test_a_forecast_that_acts_holds_the_lr_until_its_horizon_and_then_gives_it_back():
    """`forecast_lr`: the forecast's step also lowers the LR scale (a temporary backoff that pins the snapshot from
    before the growth); once its horizon passed with nothing, the same factor is given back. A backoff in the
    meantime (an alarm's, which lowers the LR for good) ends the hold at the next verdict."""
    from types import SimpleNamespace

    def verdicts(check, step, value):
        m = SimpleNamespace(step=step, values={"signals": {"residual_rms": value}})
        return check.verdict(m, SimpleNamespace(model_cfg=None))

    check = Precursors(forecast_lr=0.5)
    seen = [(s, v) for s in range(20) for v in verdicts(check, s, 2.0 * 2 ** (s / 3))]
    (s0, forecast), (s1, hold) = [(s, v) for s, v in seen if v.kind in ("forecast", "forecast_hold")]
    assert forecast.kind == "forecast" and (hold.kind, hold.action, s1) == ("forecast_hold", "backoff", s0)
    assert hold.context == {"temporary": True, "factor": 0.5, "pin_before": 0}  # the fit began at step 0: its weights
    assert hold.detail["until"] == forecast.detail["by_step"]
    quiet = [v for s in range(20, forecast.detail["by_step"] + 1) for v in verdicts(check, s, 1.0)]
    assert not [v for v in quiet if v.kind == "forecast_hold"]  # held to the horizon
    (release,) = verdicts(check, forecast.detail["by_step"] + 1, 1.0)
    assert release.kind == "forecast_hold" and release.context == {"temporary": True, "factor": 2.0, "unpin": True}
    default = Precursors()  # the default: a forecast only logs (acting on the alarm alone won divergence_bench)
    kinds = [v.kind for s in range(20) for v in verdicts(default, s, 2.0 * 2 ** (s / 3))]
    assert default.forecast_lr is None and "forecast" in kinds and "forecast_hold" not in kinds
    logged = Precursors(forecast_lr=0.5, action="log")  # `action: log`: the signals never act, forecasts included
    kinds = [v.kind for s in range(20) for v in verdicts(logged, s, 2.0 * 2 ** (s / 3))]
    assert "forecast" in kinds and "forecast_hold" not in kinds
    with pytest.raises(ConfigError, match="forecast_lr"):
        Precursors(forecast_lr=1.5)
    superseded = Precursors(forecast_lr=0.5)
    for s in range(16):
        verdicts(superseded, s, 2.0 * 2 ** (s / 3))
    assert superseded.holding is not None
    superseded.restart()
    assert [v.context["factor"] for v in verdicts(superseded, 16, 1.0) if v.kind == "forecast_hold"] == [2.0]


def test_a_forecast_that_acts_lowers_the_lr_only_until_the_backoff_that_follows(make_cfg, tmp_path):
    """A real too-high LR with `forecast_lr`: the forecast lowers the LR scale at once (`forecast_hold`) and pins the
    snapshot from before the growth (here step 0: the fit began there), the alarm's backoff then lowers the LR for
    good and rewinds to that snapshot, and the hold's factor is given back: the run ends at the backoffs' scale
    alone."""
    cfg = make_cfg(
        "model.qk_norm=true",
        "optim.lr=0.06",
        "trainer.max_steps=60",
        "data.val_windows=8",
        "callbacks.stability.signals.forecast_lr=0.5",
    )
    _, objects = train(cfg)
    events = read_events(tmp_path / "run")
    holds = [e for e in events if e["kind"] == "forecast_hold"]
    forecast = next(e for e in events if e["kind"] == "forecast")
    assert holds[0]["action"] == "backoff" and holds[0]["step"] == forecast["step"]
    assert holds[0]["detail"]["lr_scale"] == pytest.approx(0.5)
    backoffs = [e for e in events if e["kind"] == "lr_backoff"]
    assert backoffs and holds[1]["detail"]["released"] and holds[1]["step"] > backoffs[0]["step"]
    assert backoffs[0]["detail"]["rewound_to"] == holds[0]["detail"]["pinned_before"] == 0
    assert objects["module"].lr_scale == pytest.approx(0.1 ** len(backoffs))  # no factor of the hold is left


def test_a_forecast_from_the_first_step_pins_the_initial_weights(make_cfg, tmp_path):
    """A growth fitted from step 0 pins the step-0 snapshot, the weights from before it (held past `keep`, a rewind
    finds it: test_snapshot.py); QK-clip's backoff that follows rewinds there."""
    cfg = make_cfg(
        "model.qk_norm=false",
        "optim.lr=0.1",
        "optim.warmup_steps=5",
        "trainer.max_steps=12",
        "trainer.limit_val_batches=0",
        "callbacks.stability.recovery.every_n_steps=5",
        "callbacks.stability.recovery.keep=1",
        "callbacks.stability.qk_clip.backoff_after=4",
        "callbacks.stability.signals.forecast_lr=0.7",
    )
    train(cfg)
    events = read_events(tmp_path / "run")
    (hold, *_) = [e for e in events if e["kind"] == "forecast_hold"]
    (rewind,) = [e for e in events if e["kind"] == "rollback"]
    assert hold["detail"]["pinned_before"] == 0 and rewind["detail"]["to_step"] == 0 < hold["step"] < rewind["step"]


def test_log_z_from_the_default_loss_fires_its_precursor_in_a_real_fit(make_cfg, tmp_path):
    """The chunked loss (the default) hands the stats its log Z: logged every stats step, judged, backed off from.
    The byte vocabulary starts at log Z ~ ln 257 = 5.55; a level of 5 sits under it, so every stats step alarms."""
    cfg = make_cfg("model.qk_norm=true", "callbacks.stability.signals.log_z=5.0")
    assert cfg.optim.loss == "chunked"
    train(cfg)
    logged = scalars(tmp_path / "run")["stability/log_z"]
    events = read_events(tmp_path / "run")
    alarms = [e for e in events if e["kind"] == "precursor"]
    assert [e["step"] for e in alarms[:3]] == [4, 9, 14]  # the stats steps (log_every_n_steps=5)
    assert all(e["detail"]["signal"] == "log_z" and e["detail"]["threshold"] == 5.0 for e in alarms)
    assert [e["detail"]["value"] for e in alarms[:3]] == pytest.approx(logged[:3], rel=1e-6)
    assert 5.0 < logged[0] < 6.0
    (backoff,) = [e for e in events if e["kind"] == "lr_backoff"][:1]
    assert backoff["step"] == 14 and backoff["detail"]["cause"] == "log_z"
    finish_job(cfg, {"train/loss": 3.0, "val/loss": 3.0})
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "unstable" and "|log Z| drifted past 5" in result["reason"]
