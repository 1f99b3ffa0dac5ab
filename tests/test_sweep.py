"""Sweep bookkeeping: each job's outcome, and the summary (table + PNG) with unstable and diverged jobs marked."""

import json
import math
from pathlib import Path

import pytest

from steadylm.config import compose, sweep_dir
from steadylm.jobs import finished_job
from steadylm.result import divergence
from steadylm.stability.instability import instability
from steadylm.stability.qk_clip import MATERIAL_CLIPS, PERSISTENT_ALARMS
from steadylm.sweep import summarize_sweep
from tests.helpers import CLI_TINY, run_cli


def write_job(sweep: Path, num: int, overrides: list[str], result: dict | None) -> None:
    job = sweep / str(num)
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if result is not None:
        (job / "result.json").write_text(json.dumps(result))


def test_divergence_names_its_cause(tmp_path):
    assert divergence({"train/loss": 2.0, "val/loss": 2.1}, tmp_path) is None
    assert divergence({"train/loss": math.nan}, tmp_path) == "non-finite train/loss"
    assert divergence({"val/loss": math.inf}, tmp_path) == "non-finite val/loss"
    (tmp_path / "stability").mkdir()
    events = [
        {"step": 3, "kind": "loss_spike", "action": "log", "detail": {}},
        {"step": 7, "kind": "nonfinite_grad", "action": "stop", "detail": {}},
    ]
    (tmp_path / "stability" / "events.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in events) + '{"step": 8, "ki'
    )
    assert divergence({"val/loss": 2.0}, tmp_path) == "stopped on nonfinite_grad at step 7"


def write_events(run: Path, events: list[dict]) -> None:
    (run / "stability").mkdir(parents=True, exist_ok=True)
    (run / "stability" / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def clip(step: int, logit: float = 150.0) -> dict:
    return {"step": step, "kind": "qk_clip", "action": "clip", "detail": {"max_logit": logit, "tau": 100.0}}


def test_instability_is_material_clipping_a_backoff_or_persisting_alarms(tmp_path):
    """A few clips are the policy doing its job; MATERIAL_CLIPS of them, any LR backoff, or PERSISTENT_ALARMS
    unmitigated alarms make the run unstable, with the cause and the fix in one line."""
    assert instability(tmp_path) is None  # no events file at all
    write_events(tmp_path / "few", [clip(s) for s in range(MATERIAL_CLIPS - 1)])
    assert instability(tmp_path / "few", lr=0.1) is None
    write_events(tmp_path / "many", [clip(s, 100.0 + s) for s in range(3, 3 + MATERIAL_CLIPS)])
    line = instability(tmp_path / "many", lr=0.1)
    assert line.startswith(
        f"attention logits grew past the bar from step 3 (max 112); QK-clip acted on {MATERIAL_CLIPS}"
    )
    assert "fix: model.qk_norm=true, or optim.lr=0.0333" in line and "\n" not in line
    backoff = {"step": 9, "kind": "lr_backoff", "action": "backoff", "detail": {"lr_scale": 0.25}}
    write_events(tmp_path / "backoff", [clip(5), backoff])
    assert "lowered the LR 1 time(s) to x0.25; fix: model.qk_norm=true, or optim.lr=0.025" in instability(
        tmp_path / "backoff", lr=0.1
    )
    alarm = {"kind": "attn_logit", "action": "log", "detail": {"value": 300.0, "threshold": 100.0}}
    write_events(tmp_path / "alarms", [{**alarm, "step": s} for s in range(PERSISTENT_ALARMS)])
    assert f"on {PERSISTENT_ALARMS} logging steps, unmitigated" in instability(tmp_path / "alarms")


def test_summary_marks_diverged_and_missing_jobs(tmp_path):
    ok = dict(status="ok", reason=None, val_loss=2.5)
    write_job(tmp_path, 0, ["optim.lr=0.001"], {**ok, "lr": 1e-3, "overrides": ["optim.lr=0.001"]})
    write_job(tmp_path, 1, ["optim.lr=0.003"], {**ok, "lr": 3e-3, "val_loss": 2.2, "overrides": ["optim.lr=0.003"]})
    diverged = dict(
        status="diverged", reason="non-finite val/loss", lr=10.0, val_loss=math.nan, overrides=["optim.lr=10"]
    )
    write_job(tmp_path, 2, ["optim.lr=10"], diverged)
    write_job(tmp_path, 10, ["optim.lr=30"], None)  # killed before it could write a result
    unstable = dict(status="unstable", reason="QK-clip acted", lr=0.1, val_loss=2.7, overrides=["optim.lr=0.1"])
    write_job(tmp_path, 3, ["optim.lr=0.1"], unstable)
    jobs = summarize_sweep(tmp_path)
    assert [j["job"] for j in jobs] == ["0", "1", "2", "3", "10"]
    assert [j["status"] for j in jobs] == ["ok", "ok", "diverged", "unstable", "missing"]
    assert "| 3 | `optim.lr=0.1` | 0.1 | 2.7 | unstable | QK-clip acted |" in (tmp_path / "summary.md").read_text()
    table = (tmp_path / "summary.md").read_text()
    assert "| 1 | `optim.lr=0.003` | 0.003 | 2.2 | ok |" in table
    assert "| 2 | `optim.lr=10` | 10 | nan | diverged | non-finite val/loss |" in table
    assert "| 10 | `optim.lr=30` | — | — | missing | no result.json |" in table
    assert (tmp_path / "summary.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_three_job_multirun_summary_marks_the_diverged_job(shards_dir, tmp_path):
    proc = run_cli(
        "-m",
        "trainer=cpu",
        "optim.lr=1e-3,3e-3,1e6",
        "optim.min_lr=0",
        "trainer.gradient_clip_val=null",
        f"data.dir={shards_dir}",
        *CLI_TINY,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = next((tmp_path / "logs" / "train" / "multiruns").iterdir())
    assert f"sweep summary: {sweep / 'summary.md'} (3 jobs, 0 unstable, 1 diverged)" in proc.stdout
    results = [json.loads((sweep / str(i) / "result.json").read_text()) for i in range(3)]
    assert [r["status"] for r in results] == ["ok", "ok", "diverged"]
    assert [r["lr"] for r in results] == [1e-3, 3e-3, 1e6]
    assert all(math.isfinite(r["val_loss"]) for r in results[:2])
    table = (sweep / "summary.md").read_text()
    assert "| 2 | `trainer=cpu` `optim.lr=1000000.0`" in table and "| diverged |" in table
    assert (sweep / "summary.png").stat().st_size > 1000


@pytest.mark.slow
def test_optuna_search_optimises_val_loss(shards_dir, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="optional extra: pip install -e '.[sweep]'")
    proc = run_cli(
        "hparams_search=lr_optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.n_startup_trials=1",
        "trainer=cpu",
        f"data.dir={shards_dir}",
        *CLI_TINY,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = next((tmp_path / "logs" / "train" / "multiruns").iterdir())
    best = (sweep / "optimization_results.yaml").read_text()
    assert "optim.lr" in best and "best_value" in best
    values = [json.loads((sweep / str(i) / "result.json").read_text())["val_loss"] for i in range(2)]
    assert f"best_value: {min(values)}" in best  # the sweeper minimised what train() returned


@pytest.mark.slow
def test_optuna_search_runs_each_trial_on_two_processes(shards_dir, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="optional extra: pip install -e '.[sweep]'")
    proc = run_cli(
        "hparams_search=lr_optuna",
        "hydra.sweeper.n_trials=2",
        "hydra.sweeper.sampler.n_startup_trials=1",
        "trainer=ddp_sim",
        f"data.dir={shards_dir}",
        "+callbacks.probe._target_=test_distributed.RankProbe",
        *CLI_TINY,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = next((tmp_path / "logs" / "train" / "multiruns").iterdir())
    for trial in ("0", "1"):  # each trial's extra process ran that trial (the config asks for MULTIRUN itself)
        assert sorted(p.name for p in (sweep / trial).glob("rank*.txt")) == ["rank0.txt", "rank1.txt"]
    values = [json.loads((sweep / str(i) / "result.json").read_text())["val_loss"] for i in range(2)]
    assert f"best_value: {min(values)}" in (sweep / "optimization_results.yaml").read_text()
    assert f"sweep summary: {sweep / 'summary.md'} (2 jobs" in proc.stdout


def test_resume_auto_continues_the_newest_sweep_folder(tmp_path):
    base = tmp_path / "multiruns"
    assert sweep_dir(str(base), "2026-12-07_10-00-00", "auto") == f"{base}/2026-12-07_10-00-00"  # none yet: new
    for name in ("2026-12-06_09-00-00", "2026-12-07_08-00-00"):
        (base / name).mkdir(parents=True)
    assert sweep_dir(str(base), "2026-12-07_10-00-00", "auto") == str(base / "2026-12-07_08-00-00")
    assert sweep_dir(str(base), "2026-12-07_10-00-00", None) == f"{base}/2026-12-07_10-00-00"  # no resume: new
    cfg = compose(["resume=auto", f"paths.log_dir={tmp_path}", "task_name=x"])
    assert (
        cfg.hydra.sweep.dir == str(tmp_path / "x" / "multiruns" / "2026-12-07_08-00-00")
        or not (tmp_path / "x").exists()
    )


@pytest.mark.parametrize(
    "status,expected",
    [("ok", (2.5, "ok")), ("diverged", "nan"), ("preempted", None), ("failed", None), (None, None)],
)
def test_resume_auto_skips_a_finished_job_with_the_number_it_gave(tmp_path, status, expected):
    """A finished job is skipped with its number (NaN for diverged); a preempted or failed one runs again."""
    run = tmp_path / "0"
    run.mkdir()
    if status:
        (run / "result.json").write_text(json.dumps({"status": status, "val_loss": 2.5}))
    cfg = compose([f"paths.output_dir={run}", "resume=auto"])
    done = finished_job(cfg)
    if expected == "nan":
        assert math.isnan(done[0]) and done[1] == "diverged"  # a sweeper records the trial as failed again
    else:
        assert done == expected
    assert finished_job(compose([f"paths.output_dir={run}"])) is None  # without resume=auto every job runs
