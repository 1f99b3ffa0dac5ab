"""A stability check is one file: defined here, added through config alone, judged, logged and resumed like a
built-in one (`steadylm.stability.check`)."""

from __future__ import annotations

import statistics

import lightning as L
import pytest
import torch

from steadylm.errors import ConfigError
from steadylm.stability import read_events
from steadylm.stability.backoff import Backoff
from steadylm.stability.check import Check
from steadylm.stability.signals import Precursors
from steadylm.stability.verdict import OK, Verdict
from tests.helpers import FAST, faults, fit, stability_of


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


class TailLoss(Check):
    """A forker's check: the mean loss on the last `positions` of each window above `factor` times its running median
    (what a data pipeline that cuts documents badly, or a broken long-range attention, shows first)."""

    wants_token_losses = True  # the loss keeps each position's CE for this check's steps

    def __init__(
        self,
        positions: int = 8,
        factor: float = 1.5,
        window: int = 32,
        warmup: int = 4,
        lr_backoff: float | None = None,
    ) -> None:
        self.positions, self.factor, self.window, self.warmup = int(positions), float(factor), int(window), int(warmup)
        self.history: list[float] = []
        self.restored_from: dict | None = None
        # lr_backoff: also lower the LR by this factor (once), through the suite's one backoff mechanism
        self.backoff = Backoff("tail_loss", lr_backoff, max_backoffs=1, rewind=False, rewarm_steps=0)

    def measure(self, view):
        tails = torch.stack([t[:, -self.positions :].mean() for t in view.token_losses])
        return {"tail": ("mean", tails.mean())}

    def verdict(self, m, view):
        tail = m.values[self.name]["tail"]
        if m.nonfinite:
            return OK
        recent = self.history[-self.window :]
        median = statistics.median(recent) if len(recent) >= self.warmup else None
        self.history.append(tail)
        if median is None or tail <= self.factor * median:
            return OK
        evidence = {"tail": tail, "median": median, "factor": self.factor}
        if (granted := self.backoff.ask(m.step)) is None:
            return Verdict("log", self.name, evidence, onset=m.step)
        context = {"backoff": granted, "policy": self.backoff, "cause": self.name, "why": "the tail loss jumped"}
        return Verdict("backoff", self.name, evidence, onset=m.step, context=context)

    # what it has seen of the weights: copied with each snapshot, given back by a rollback
    def window_state(self) -> dict:
        return {"history": list(self.history)}

    def load_window_state(self, state: dict) -> None:
        self.restored_from = state
        self.history = list(state["history"])

    def state_dict(self) -> dict:
        return self.window_state()

    def load_state_dict(self, state: dict) -> None:
        self.history = list(state["history"])

    @staticmethod
    def explain(events, lr, cut):
        """The run's `unstable` line from this check's events (any: the tail of a window should never jump)."""
        alarms = [e for e in events if e["kind"] == "tail_loss"]
        if not alarms:
            return None
        d = alarms[0]["detail"]
        lowered = [e for e in events if e["kind"] == "lr_backoff"]
        acted = f"; the LR lowered to x{lowered[-1]['detail']['lr_scale']:g}" if lowered else ""
        return (
            f"the loss on the last positions of a window rose above {d['factor']:g}x its running median on "
            f"{len(alarms)} step(s) from step {alarms[0]['step']} ({d['tail']:.3g} against {d['median']:.3g}){acted}; "
            "fix: read the windows of those steps (python -m steadylm.diagnose.window) for documents cut badly"
        )

    @staticmethod
    def describe(events, log):
        """diagnose's finding: the first step, with the train loss last logged before it (from the run's record)."""
        steps, loss = log.series("train/loss")
        before = [(int(s), float(v)) for s, v in zip(steps, loss) if s < events[0]["step"]]
        logged = f", train/loss {before[-1][1]:.3f} at step {before[-1][0]}" if before else ""
        d = events[0]["detail"]
        summary = (
            f"tail loss {d['tail']:.3g} > {d['factor']:g}x median {d['median']:.3g} at step {events[0]['step']}{logged}"
        )
        return [{"onset": events[0]["step"], "cause": "tail_loss", "summary": summary, "fix": "read those windows"}]


TAIL = "+callbacks.stability.checks.tail_loss={_target_: tests.test_checks.TailLoss, factor: 2, window: 8}"


def test_a_forkers_check_sees_the_per_position_loss_ends_the_run_unstable_and_is_diagnosed(make_cfg, tmp_path):
    from steadylm.diagnose.findings import analyse
    from steadylm.diagnose.runlog import load_run
    from steadylm.result import finish_job

    labels = faults({"kind": "corrupt_labels", "step": 24})  # one batch of random labels: every position's loss jumps
    cfg = make_cfg(*FAST, "trainer.max_steps=30", "optim.lr=1e-2", TAIL, labels)
    objs = fit(cfg)
    check = next(c for c in stability_of(objs["trainer"]).checks if c.name == "tail_loss")
    assert objs["module"].token_losses.shape == (4, 32)  # kept for the check: one CE a position
    events = [e for e in read_events(tmp_path / "run") if e["kind"] == "tail_loss"]
    assert [e["step"] for e in events] == [24]  # the scrambled labels' step, its tail far above its median
    assert events[0]["detail"]["tail"] > 2 * events[0]["detail"]["median"] and len(check.history) == 30
    _, status, reason = finish_job(cfg, {"train/loss": 3.0, "val/loss": 3.0})
    line = TailLoss.explain(events, None, None)
    assert status == "unstable" and reason == line
    diagnosis = analyse(load_run(tmp_path / "run"))
    found = [f for f in diagnosis.findings if f.cause == "tail_loss"]
    assert [(f.onset, f.fix) for f in found] == [(24, "read those windows")]
    assert found[0].summary.startswith("tail loss ") and ", train/loss " in found[0].summary  # it read the run's log
    assert f"unstable: {line}" in diagnosis.facts  # the line result.json gives, read from the same place


def test_a_forkers_check_that_backs_off_keeps_its_own_line(make_cfg, tmp_path):
    """The backoff goes through the suite's mechanism (an `lr_backoff` event whose cause is the check); result.json
    and diagnose read it as the check's own, never as a built-in's (the signals check claimed every backoff)."""
    from steadylm.diagnose.findings import analyse
    from steadylm.diagnose.runlog import load_run
    from steadylm.result import finish_job

    labels = faults({"kind": "corrupt_labels", "step": 24})
    tail = TAIL.replace("window: 8}", "window: 8, lr_backoff: 0.5}")
    cfg = make_cfg(*FAST, "trainer.max_steps=30", "optim.lr=1e-2", tail, labels)
    objs = fit(cfg)
    events = read_events(tmp_path / "run")
    (backoff,) = [e for e in events if e["kind"] == "lr_backoff"]
    assert backoff["step"] == 24 and backoff["detail"]["cause"] == "tail_loss" and objs["module"].lr_scale == 0.5
    _, status, reason = finish_job(cfg, {"train/loss": 3.0, "val/loss": 3.0})
    assert status == "unstable" and reason == TailLoss.explain(events, None, None)
    assert reason.startswith("the loss on the last positions") and "the LR lowered to x0.5" in reason
    diagnosis = analyse(load_run(tmp_path / "run"))
    assert f"unstable: {reason}" in diagnosis.facts
    assert [f.cause for f in diagnosis.findings] == ["tail_loss"]  # no built-in finding made of its backoff


def test_a_check_that_does_not_ask_costs_the_loss_nothing(make_cfg):
    objs = fit(make_cfg(*FAST, "trainer.max_steps=6"))
    assert objs["module"].token_losses is None


def test_a_rollback_gives_a_check_back_what_it_had_seen_of_the_restored_weights(make_cfg, tmp_path):
    nan = [{"kind": "nan_loss", "step": s} for s in (9, 10, 11)]  # three in a row: the guard rolls back to step 8
    objs = fit(make_cfg(*FAST, "trainer.max_steps=16", TAIL, faults(*nan)))
    check = next(c for c in stability_of(objs["trainer"]).checks if c.name == "tail_loss")
    rollback = [e for e in read_events(tmp_path / "run") if e["kind"] == "rollback"]
    assert [e["detail"]["to_step"] for e in rollback] == [8]
    kept = check.restored_from["history"]
    assert len(kept) == 8 and check.history[: len(kept)] == kept  # steps 0-7, then on from the restored weights


def test_a_check_diagnosed_away_from_its_code_is_described_by_its_events():
    from steadylm.stability.instability import described

    events = [{"step": 7, "kind": "mine", "action": "log", "detail": {"value": 3.0}}]
    (found,) = described(events, None, {"mine": "nowhere_pkg.Mine"})
    assert (found["onset"], found["cause"]) == (7, "mine") and "1 mine event(s) from step 7" in found["summary"]
