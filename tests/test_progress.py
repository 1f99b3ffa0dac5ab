"""The console while training: one plain line per logging step (loss, tokens/s, stability status), one per
validation, and the events log's status in words."""

from __future__ import annotations

import json
from types import SimpleNamespace

from steadylm.progress import ProgressLines, live_forecast
from steadylm.train import train


def test_one_line_per_logging_step_and_per_validation(make_cfg, capsys):
    cfg = make_cfg(
        "trainer.enable_progress_bar=true",
        "trainer.max_steps=10",
        "trainer.log_every_n_steps=5",
        "trainer.val_check_interval=null",
    )
    train(cfg)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(("step ", "val "))]
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split(" | ")[0] for s in steps] == ["step 5/10", "step 10/10"]
    assert steps[0].split(" | ")[1].startswith("loss ") and steps[-1].endswith("stability: ok")
    assert " tok/s | " in steps[-1]  # measured between the two logging steps
    vals = [line.split(" | ")[0] for line in lines if line.startswith("val ")]
    assert vals == ["val  2/10", "val  4/10", "val  6/10", "val  8/10", "val  10/10"]  # every ceil(10/5) steps


def test_the_stability_status_names_the_events(tmp_path):
    bar, trainer = ProgressLines(), SimpleNamespace(default_root_dir=str(tmp_path))
    assert bar._stability(trainer) == "ok"  # no log yet
    (tmp_path / "stability").mkdir()
    event = {"step": 7, "kind": "loss_spike", "action": "skip", "detail": {}}
    (tmp_path / "stability" / "events.jsonl").write_text(json.dumps(event) + "\n")
    assert bar._stability(trainer) == "1 event(s), last loss_spike -> skip at step 7"


def test_a_live_forecast_is_named_until_its_signal_alarms():
    forecast = {"step": 20, "kind": "forecast", "action": "log"}
    forecast["detail"] = {"signal": "residual_rms", "value": 31.4, "threshold": 100.0, "expected_step": 31}
    assert live_forecast([forecast]) == forecast["detail"]
    alarm = {"step": 30, "kind": "precursor", "action": "log", "detail": {"signal": "residual_rms"}}
    assert live_forecast([forecast, alarm]) is None
    spike = {"step": 25, "kind": "loss_spike", "action": "log", "detail": {}}
    assert live_forecast([forecast, spike]) == forecast["detail"]  # another kind: the forecast still stands
