"""A stability check is one file: defined here, added through config alone, judged, logged and resumed like a
built-in one (`steadylm.stability.check`)."""

from __future__ import annotations

import statistics

import lightning as L
import pytest
import torch

from steadylm.errors import ConfigError
from steadylm.stability import read_events
from steadylm.stability.check import Check
from steadylm.stability.signals import Precursors
from steadylm.stability.verdict import OK, Verdict
from tests.helpers import FAST, fit, stability_of


class EmbeddingGradSpike(Check):
    """The token embedding's grad norm above `factor` times the median of the norms before it: an event."""

    def __init__(self, factor: float = 3.0, warmup: int = 3, action: str = "log") -> None:
        self.factor, self.warmup, self.action = float(factor), int(warmup), action
        self.acts_before_update = action == "skip"
        self.seen: list[float] = []

    def measure(self, view):
        return {"norm": ("max", view.module.net.wte.weight.grad.norm())}

    def verdict(self, m, view) -> Verdict:
        norm = m.values[self.name]["norm"]
        median = statistics.median(self.seen) if len(self.seen) >= self.warmup else None
        self.seen.append(norm)
        if median is None or norm <= self.factor * median:
            return OK
        return Verdict(self.action, self.name, {"value": norm, "median": median}, onset=m.step)

    def state_dict(self) -> dict:
        return {"seen": list(self.seen)}

    def load_state_dict(self, state: dict) -> None:
        self.seen = list(state["seen"])


class EmbeddingGradNorms(L.Callback):
    """The truth: the embedding's pre-clip grad norm at each optimizer step."""

    def __init__(self) -> None:
        self.norms: dict[int, float] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.norms[trainer.global_step] = pl_module.net.wte.weight.grad.norm().item()


def check_override(**settings) -> str:
    args = ", ".join(f"{k}: {v}" for k, v in settings.items())
    return f"+callbacks.stability.checks.embed_grad={{_target_: tests.test_checks.EmbeddingGradSpike, {args}}}"


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "same-step"])
def test_a_check_named_in_config_measures_in_the_step_and_writes_events_under_its_name(make_cfg, tmp_path, defer):
    truth = EmbeddingGradNorms()
    cfg = make_cfg(*FAST, f"callbacks.stability.defer={defer}", check_override(factor=1.0))
    objs = fit(cfg, truth)
    owner = stability_of(objs["trainer"])
    check = next(c for c in owner.checks if c.name == "embed_grad")
    assert check.seen == pytest.approx([truth.norms[s] for s in range(12)], rel=1e-5)  # every step, its own value
    events = [e for e in read_events(tmp_path / "run") if e["kind"] == "embed_grad"]
    assert events, "a factor of 1 over the median must fire on a 12-step run"
    for e in events:
        assert e["action"] == "log" and e["step"] >= 3
        assert e["detail"]["value"] == pytest.approx(truth.norms[e["step"]], rel=1e-5)
        assert e["detail"]["value"] > e["detail"]["median"]
    assert owner.state_dict()["embed_grad"] == {"seen": check.seen}  # kept in every checkpoint, by its name


def test_a_check_may_skip_the_step_it_judges(make_cfg, tmp_path):
    cfg = make_cfg(*FAST, check_override(factor=1.0, action="skip"))
    before = {}

    class Weights(L.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            before[trainer.global_step] = pl_module.net.wte.weight.detach().clone()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            step = trainer.global_step - 1
            same = torch.equal(before[step], pl_module.net.wte.weight)
            before[step] = same

    objs = fit(cfg, Weights())
    skipped = [e["step"] for e in read_events(tmp_path / "run") if e["kind"] == "embed_grad"]
    assert skipped and objs["module"].skipped_steps == len(skipped)
    assert all(before[s] is True for s in skipped)  # no update reached the weights on a skipped step
    assert not any(before[s] is True for s in range(12) if s not in skipped)


def test_a_check_resumes_with_its_state(make_cfg, tmp_path):
    from steadylm.train import train

    args = [*FAST, "optim.total_steps=12", check_override(factor=100.0)]
    train(make_cfg(*args, "trainer.max_steps=8"))
    _, resumed = train(make_cfg(*args, "resume=auto"))
    whole = fit(make_cfg(*args, out=tmp_path / "whole"))
    seen = [c.seen for c in stability_of(resumed["trainer"]).checks if c.name == "embed_grad"][0]
    assert seen == pytest.approx([c.seen for c in stability_of(whole["trainer"]).checks if c.name == "embed_grad"][0])


@pytest.mark.parametrize(
    "override, message",
    [
        ("+callbacks.stability.checks.spike={_target_: tests.test_checks.EmbeddingGradSpike}", "built-in"),
        ("+callbacks.stability.checks.mine={factor: 2}", "no _target_"),
        ("+callbacks.stability.checks.mine={_target_: datetime.timedelta}", "no verdict"),
        ("+callbacks.stability.spiek={sigma: 5}", "callbacks.stability.spiek is not a part"),  # a misspelled part
    ],
)
def test_a_check_that_cannot_be_one_is_refused_in_one_line(make_cfg, override, message):
    with pytest.raises(ConfigError, match=message):
        fit(make_cfg(*FAST, override))


def test_a_value_a_check_measures_becomes_a_signal_through_config_alone(make_cfg, tmp_path):
    """`callbacks.stability.signals.watch` names a check's measured key: the signals forecast and alarm it every
    step like their own, with no edit to signals.py. Here the level sits far below the embedding's grad norm, so
    the first step alarms, once for the episode; the value is the check's own, reduced in the step's collective."""
    truth = EmbeddingGradNorms()
    watch = "+callbacks.stability.signals.watch.embed={value: embed_grad.norm, level: 1.0e-9}"
    fit(make_cfg(*FAST, check_override(factor=100.0), watch), truth)
    alarms = [e for e in read_events(tmp_path / "run") if e["kind"] == "precursor"]
    assert [e["detail"]["signal"] for e in alarms] == ["embed"] and alarms[0]["step"] == 0
    assert alarms[0]["detail"]["value"] == pytest.approx(truth.norms[0], rel=1e-5)


def test_a_watched_signal_is_forecast_from_its_values_and_a_bad_entry_is_one_line():
    signals = Precursors(watch={"embed": {"value": "embed_grad.norm", "level": 100.0}})
    grows = [(s, 2.0 * 2 ** (s / 3)) for s in range(20)]
    forecasts = [v for s, x in grows for v in signals.watch(s, {"embed": x}) if v.kind == "forecast"]
    assert [v.detail["signal"] for v in forecasts] == ["embed"] and forecasts[0].detail["expected_step"] == 17
    with pytest.raises(ConfigError, match=r"signals\.watch\.embed must be \{value: CHECK\.KEY, level: X > 0\}"):
        Precursors(watch={"embed": {"value": "norm", "level": 1.0}})
    with pytest.raises(ConfigError, match=r"signals\.watch\.residual_rms must be"):
        Precursors(watch={"residual_rms": {"value": "a.b", "level": 1.0}})
