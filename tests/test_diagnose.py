"""Diagnose: real TensorBoard event files and events.jsonl in, report.md naming onset and cause out."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

from steadylm.diagnose import analyse, load_run, write_report
from steadylm.run_config import write_run_config
from tests.helpers import CLI_TINY, run_cli

ROOT = Path(__file__).resolve().parents[1]
PLOTS = ("loss", "lr", "grad_norm", "block_grad_norm", "update_ratio", "attn_logit")


def write_run(
    run: Path, scalars: dict[str, list[float]], events=(), config: dict | None = None, torn: bool = False
) -> Path:
    writer = SummaryWriter(str(run / "tensorboard"))
    for tag, values in scalars.items():
        for step, value in enumerate(values):
            writer.add_scalar(tag, value, step)
    writer.close()
    if events or torn:
        (run / "stability").mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"step": s, "kind": k, "action": a, "detail": d, "time": 0.0}) for s, k, a, d in events]
        (run / "stability" / "events.jsonl").write_text("\n".join(lines) + ('\n{"step": 9' if torn else "\n"))
    if config is not None:
        write_run_config(run, config)
    return run


def healthy_curves(n: int = 100) -> dict[str, list[float]]:
    steps = np.arange(n)
    return {
        "train/loss": list(5.6 * np.exp(-steps / 60) + 1.5 + 0.05 * np.sin(steps)),
        "optim/lr": [3e-3 * min(1.0, (s + 1) / 10) for s in steps],
        "optim/grad_norm": list(1.0 + 0.1 * np.cos(steps)),
        "stability/grad_norm/block_0": list(0.5 + 0.0 * steps),
        "stability/grad_norm/block_1": list(0.7 + 0.0 * steps),
        "stability/update_ratio": list(1e-3 + 0.0 * steps),
        "stability/max_attn_logit/block_0": list(5 + 0.01 * steps),
    }


CONFIG = {"optim": {"lr": 3e-3, "warmup_steps": 10}, "trainer": {"gradient_clip_val": 1.0, "precision": "32-true"}}


def report(run: Path):
    diagnosis = analyse(load_run(run))
    return diagnosis, write_report(load_run(run), diagnosis).read_text()


def test_healthy_run_reports_no_instability_and_draws_every_plot(tmp_path):
    run = write_run(tmp_path / "run", healthy_curves(), config=CONFIG)
    diagnosis, text = report(run)
    assert diagnosis.primary is None
    assert "**No instability found.**" in text
    for name in PLOTS:
        png = run / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 3000, name
        assert f"![{name}]({name}.png)" in text


def test_grad_norm_growth_at_peak_lr_without_clipping(tmp_path):
    curves = healthy_curves()
    curves["optim/grad_norm"] = [1.0] * 40 + [1.0 * 1.08**i for i in range(50)] + [math.nan] * 10
    curves["train/loss"] = curves["train/loss"][:85] + [9.0, 12.0] + [math.nan] * 13
    config = {**CONFIG, "trainer": {"gradient_clip_val": None, "precision": "32-true"}}
    diagnosis, text = report(write_run(tmp_path / "run", curves, config=config))
    p = diagnosis.primary
    assert p.cause == "no clipping" and abs(p.onset - 85) <= 2
    assert "grad norm rose 32x to 31.9 over 50 steps" in p.summary and "(peak)" in p.summary
    assert "trainer.gradient_clip_val=1.0" in p.fix
    assert f"**Onset: step {p.onset}.** **Cause: no clipping**" in text


def test_first_nonfinite_module_is_named_before_its_consequences(tmp_path):
    curves = healthy_curves()
    events = [
        (60, "nonfinite_loss", "skip", {"module": "blocks.3.attn", "value": math.inf, "batch": [[7, 8]]}),
        (61, "nonfinite_loss", "skip", {"module": "blocks.3.attn"}),
        (62, "nonfinite_loss", "stop", {"module": "blocks.3.attn"}),
        (62, "stop", "stop", {"module": "blocks.3.attn"}),
    ]
    diagnosis, text = report(write_run(tmp_path / "run", curves, events, config=CONFIG))
    p = diagnosis.primary
    assert (p.onset, p.cause) == (60, "non-finite forward")
    assert "first non-finite output in blocks.3.attn at step 60 (skipped x2, stopped the run)" in p.summary
    assert "| 60 | nonfinite_loss | skip |" in text


def test_transient_loss_spike_is_a_bad_batch_with_its_windows(tmp_path):
    curves = healthy_curves()
    curves["train/loss"][70] = 9.5
    events = [(70, "loss_spike", "skip", {"value": 9.5, "threshold": 2.9, "batch": [[12, 345]]})]
    p = analyse(load_run(write_run(tmp_path / "run", curves, events, config=CONFIG))).primary
    assert (p.onset, p.cause) == (70, "bad data batch")
    assert "on data window(s) [[12, 345]], skipped x1" in p.summary


def test_crashed_run_with_partial_logs_still_gets_a_report(tmp_path):
    curves = {"train/loss": healthy_curves()["train/loss"][:30] + [math.nan]}  # nothing else was logged
    run = write_run(tmp_path / "run", curves, torn=True)  # no config, a torn events.jsonl line, no stats
    diagnosis, text = report(run)
    assert diagnosis.onset == 30
    assert "not JSON (torn write at a crash?)" in text and "no run config" in text
    assert all((run / f"{name}.png").stat().st_size > 1000 for name in PLOTS)  # placeholders say "not logged"


def test_cli_on_an_empty_folder_and_a_missing_one(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "steadylm.diagnose", str(tmp_path / "empty")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr == f"error: {tmp_path / 'empty'}: an empty folder, not a run; " + (
        "pass the run's output dir, e.g. logs/train/runs/<time>\n"
    )
    assert not (tmp_path / "empty" / "report.md").exists()
    proc = subprocess.run(
        [sys.executable, "-m", "steadylm.diagnose", str(tmp_path / "nope")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "not a folder" in proc.stderr


# Each divergence preset, run for real on the tiny model: the report names the cause and its onset.
# conftest's tiny overrides win over a preset's values, so the keys a preset's story depends on are restated.
PRESETS = [
    ("nan_weight", ["trainer.max_steps=40"], "non-finite forward", 25, "blocks.1.mlp.fc"),
    ("inf_grad", ["trainer.max_steps=40"], "non-finite gradient", 25, "blocks.0.attn.qkv"),
    ("corrupted_batch", ["trainer.max_steps=50"], "bad data batch", 45, "data window"),
    ("lr_spike", ["trainer.max_steps=80"], "oversized update (LR spike)", 49, "update/param ratio"),
    ("high_lr", ["trainer.max_steps=40"], "attention logit growth", None, "max attention logit"),
    (
        "no_clip_no_warmup",
        ["trainer.max_steps=40", "optim.warmup_steps=0"],
        "no clipping, no warmup",
        None,
        "no clipping and no warmup",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("preset,extra,cause,onset,evidence", PRESETS, ids=[p[0] for p in PRESETS])
def test_divergence_preset_report_names_cause_and_onset(make_cfg, tmp_path, preset, extra, cause, onset, evidence):
    from steadylm.train import train

    train(make_cfg(f"experiment=divergence/{preset}", *extra))
    run = tmp_path / "run"
    diagnosis, text = report(run)
    p = diagnosis.primary
    assert p is not None and p.cause == cause, text
    if onset is not None:
        assert abs(p.onset - onset) <= 3, text
    else:
        assert p.onset <= 20, text  # the recipe is hot from the start: alarms within the first stats steps
    assert evidence in p.summary
    assert all((run / f"{name}.png").stat().st_size > 3000 for name in PLOTS)


@pytest.mark.slow
def test_real_healthy_run_reports_none(make_cfg, tmp_path):
    from steadylm.train import train

    train(make_cfg())
    diagnosis, text = report(tmp_path / "run")
    assert diagnosis.primary is None and "**No instability found.**" in text


def test_a_precursor_signal_is_named_with_its_lead_and_plotted(tmp_path):
    """The residual stream grows by orders of magnitude: the finding names the signal, the forecast's step and
    how far ahead of the alarm it came, and what the suite did; signals.png holds its panel."""
    curves = healthy_curves()
    curves["stability/act_rms/block_0"] = [0.5 * 2 ** (s / 8) for s in range(100)]
    detail = {"signal": "residual_rms", "threshold": 100.0}
    events = [
        (40, "forecast", "log", {**detail, "value": 16.0, "doubling_steps": 8.0, "expected_step": 61}),
        *(
            (s, "precursor", "log", {**detail, "value": 0.5 * 2 ** (s / 8), "streak": i + 1})
            for i, s in enumerate((62, 64, 66))
        ),
        (66, "lr_backoff", "backoff", {"cause": "residual_rms", "lr_backoff": 0.1, "lr_scale": 0.1, "onset": 40}),
    ]
    diagnosis, text = report(write_run(tmp_path / "run", curves, events, CONFIG))
    p = diagnosis.primary
    assert (p.onset, p.cause) == (40, "residual-stream growth")
    assert "forecast at step 40" in p.summary and "past 100 at step 62, 22 steps after the forecast" in p.summary
    assert "lowered the LR 1 time(s) to x0.1" in p.summary and "optim.lr x0.1" in p.fix
    assert "![signals](signals.png)" in text and (tmp_path / "run" / "signals.png").stat().st_size > 10_000


def test_a_forecast_whose_horizon_outlived_the_run_is_named_live(tmp_path):
    """A run that ended (or crashed) while a forecast's horizon was still open: the report says so, with the
    signal, its value and the step the level was expected at."""
    curves = healthy_curves()
    detail = {"signal": "residual_rms", "threshold": 100.0, "value": 31.0, "doubling_steps": 9.0}
    events = [(90, "forecast", "log", {**detail, "expected_step": 105, "by_step": 190})]
    diagnosis, _ = report(write_run(tmp_path / "run", curves, events, CONFIG))
    summary = diagnosis.primary.summary if diagnosis.primary else " ".join(f.summary for f in diagnosis.findings)
    assert "forecast at step 90 (31, doubling every 9 steps, level 100 expected at step 105)" in summary
    assert "still live when the run ended at step 99" in summary


@pytest.mark.slow
@pytest.mark.parametrize("setting", [[], ["optim=muon"], ["model.parametrization=mup"]], ids=["adamw", "muon", "mup"])
def test_the_tools_read_the_values_a_default_run_resolved(shards_dir, tmp_path, setting):
    """optim.lr is the width rule's interpolation in every preset: diagnose and generate read the number the run
    trained with (config.yaml, the checkpoint), never the expression."""
    run = tmp_path / "run"
    done = run_cli(
        *CLI_TINY, *setting, "trainer.max_steps=4", f"data.dir={shards_dir}", f"hydra.run.dir={run}", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lr = json.loads((run / "result.json").read_text())["lr"]
    assert "${" in (run / ".hydra" / "config.yaml").read_text()  # what Hydra saved still holds the rule
    done = run_cli(str(run), cwd=tmp_path, module="steadylm.diagnose")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert f"optim.lr={lr}," in (run / "report.md").read_text()
    ckpt = run / "checkpoints" / "last.ckpt"
    done = run_cli(f"ckpt={ckpt}", "max_new_tokens=4", cwd=tmp_path, module="steadylm.generate")
    assert done.returncode == 0 and done.stdout.strip(), done.stderr[-3000:]
