"""Every `experiment=divergence/<cause>` preset, composed for real and run once on the tiny model:
each makes its cause happen within seconds and the stability suite must catch and name it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra.utils import instantiate

from steadylm.config import CONF_DIR, compose
from steadylm.muon import Muon
from steadylm.stability import read_events
from steadylm.stability.instability import instability
from steadylm.train import train

PRESETS = sorted(p.stem for p in (CONF_DIR / "experiment" / "divergence").glob("*.yaml"))

# preset -> (step, kind, action) that must appear in events.jsonl; None for the step means "any step".
EXPECTED = {
    "nan_weight": [(25, "nonfinite_loss", "skip"), (27, "rollback", "rollback")],
    "inf_grad": [(25, "nonfinite_grad", "skip")],
    "corrupted_batch": [(45, "loss_spike", "log")],
    "lr_spike": [(49, "update_ratio", "log"), (50, "loss_spike", "rollback"), (None, "rollback", "rollback")],
    "fp16_overflow": [(4, "fp16_skip_streak", "skip")],  # the scaler skipped each overflowing step
    "high_lr": [(None, "qk_clip", "clip")],
    "no_clip_no_warmup": [(None, "qk_clip", "clip")],
    "deep_default_init": [(0, "init_loss", "log")],  # step 0's loss far from ln(V); doctor's init rows flag it too
}


# Under optim=muon: a broken update rolled back (Muon's momentum restored with the weights), and attention
# logits clipped. At high_lr's own lr 0.1 Muon's logits stay under tau in its 40 steps (its update per matrix
# has a fixed RMS, AdamW's early steps do not): lr 0.5 makes them cross.
MUON = {"lr_spike": [], "high_lr": ["optim.lr=0.5", "optim.min_lr=0.05"]}
CASES = [(name, []) for name in PRESETS] + [(name, ["optim=muon", *extra]) for name, extra in MUON.items()]


def preset_cfg(name: str, shards_dir: Path, out: Path, extra=()):
    overrides = [
        f"experiment=divergence/{name}",
        *extra,
        f"data.dir={shards_dir}",
        f"paths.output_dir={out}",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
    ]
    if name != "fp16_overflow":
        overrides.insert(0, "trainer=cpu")
    return compose(overrides)


def test_every_divergence_preset_composes_and_builds_its_callbacks(shards_dir, tmp_path):
    assert set(PRESETS) == set(EXPECTED)
    for name in PRESETS:
        cfg = preset_cfg(name, shards_dir, tmp_path / name)
        names = {key for key, node in cfg.callbacks.items() if node is not None}
        assert "stability" in names, name
        parts = cfg.callbacks.stability
        assert all(parts[k] is not None for k in ("guard", "spike", "stats", "loss_scale", "recovery")), name
        for node in cfg.callbacks.values():
            if node is not None:
                instantiate(node)


@pytest.mark.slow
@pytest.mark.parametrize("name,extra", CASES, ids=[" ".join([n, *e[:1]]) for n, e in CASES])
def test_divergence_preset_is_caught_by_the_suite(name, extra, shards_dir, tmp_path):
    if name == "fp16_overflow" and not torch.cuda.is_available():
        pytest.skip("fp16 with a loss scaler needs a CUDA GPU (Lightning runs 16-mixed as bf16 on CPU)")
    _, objs = train(preset_cfg(name, shards_dir, tmp_path / "run", extra))
    if extra:
        assert isinstance(objs["trainer"].optimizers[0], Muon)
    events = {(e["step"], e["kind"], e["action"]) for e in read_events(tmp_path / "run")}
    for step, kind, action in EXPECTED[name]:
        assert any((step is None or s == step) and (k, a) == (kind, action) for s, k, a in events), (name, events)
    if name == "nan_weight":
        named = [e for e in read_events(tmp_path / "run") if e["kind"] == "nonfinite_loss"]
        assert named and all(e["detail"]["module"] == "blocks.1.mlp.fc" for e in named)
        rollback = [e["detail"] for e in read_events(tmp_path / "run") if e["kind"] == "rollback"]
        assert rollback[0]["source"] == "snapshot_file" and rollback[0]["to_step"] == 20
    if name in ("lr_spike", "corrupted_batch", "inf_grad", "nan_weight"):  # each survives: no stop, status ok
        assert not any(e["action"] == "stop" for e in read_events(tmp_path / "run")), name
    if name in ("high_lr", "no_clip_no_warmup"):  # mitigated and finished, but never reported ok
        line = instability(tmp_path / "run")
        assert line and "fix: model.qk_norm=true" in line, name
    if name in ("high_lr", "no_clip_no_warmup") and not extra:  # the growth began in the warmup: back to step 0
        rewinds = [e["detail"] for e in read_events(tmp_path / "run") if e["kind"] == "rollback"]
        assert rewinds and rewinds[0]["cause"] == "qk_clip" and rewinds[0]["to_step"] == 0, (name, rewinds)
    if name == "deep_default_init":  # nothing diverges; the run ends unstable with the fix
        events = read_events(tmp_path / "run")
        assert {e["kind"] for e in events} - {"forecast"} == {"init_loss"}  # a forecast only logs by default
        assert "fix: use model.init=gpt2" in instability(tmp_path / "run")
    if name in ("lr_spike", "corrupted_batch"):
        spike = [e for e in read_events(tmp_path / "run") if e["kind"] == "loss_spike"][0]
        assert spike["detail"]["cause"] == ("update" if name == "lr_spike" else "data"), spike


@pytest.mark.slow
def test_natural_divergence_bench_runs_every_case_through_train_py(shards_dir, tmp_path):
    """`benchmarks/natural_divergence.py --quick`: every case with and without the mitigation, each a real
    `train.py` run whose result.json the table reads; the stable run is never mitigated."""
    out = tmp_path / "natural.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "natural_divergence.py"
    run = subprocess.run(
        [sys.executable, str(bench), "--quick", "--steps", "12", "--json", str(out), f"data.dir={shards_dir}"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted((case, col) for case, col, _, _ in rows) == sorted(
        [("optim.lr=3e-3 (stable)", "default")]
        + [
            (case, col)
            for case in ("optim.lr=0.03 (10x)", "optim.lr=0.1 (30x)", "lr 0.05, no warmup, no clipping")
            for col in ("default", "unmitigated")
        ]
    )
    assert all(r["status"] in ("ok", "unstable") and r["val_loss"] > 0 for *_, r in rows)
    assert all("qk_clip" not in r["acted"] for _, col, _, r in rows if col == "unmitigated")
    assert "optim.lr=0.1 (30x)" in run.stdout and "unmitigated" in run.stdout.splitlines()[2]


@pytest.mark.slow
def test_divergence_bench_judges_a_scenario_against_its_twins_from_real_runs(shards_dir, tmp_path):
    """`benchmarks/divergence_bench.py --only ...`: one scenario observed and under the default suite, its twin at
    three seeds and at 2x its LR, each a real `train.py` run; the table and the summary read their events. At 30x
    without QK-norm the forecast comes before the loss turns; the healthy runs get none."""
    out = tmp_path / "div.json"
    bench = Path(__file__).resolve().parents[1] / "benchmarks" / "divergence_bench.py"
    cmd = [sys.executable, str(bench), "--only", "lr 30x, no QK-norm", "--steps", "200", "--json", str(out)]
    run = subprocess.run([*cmd, f"data.dir={shards_dir}"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted(rows) == sorted(
        [f"twin | noqk | {s}" for s in (1, 2, 3)]
        + ["2x lr | noqk | 1", "observed | lr 30x, no QK-norm | 1", "default suite | lr 30x, no QK-norm | 1"]
    )
    observed = rows["observed | lr 30x, no QK-norm | 1"]
    assert observed["forecast"] is not None and observed["onset"] is not None
    assert observed["forecast"] < observed["onset"] and observed["signal"] in ("residual_rms", "attn_logit")
    assert all(r["forecasts"] == 0 for k, r in rows.items() if k.startswith(("twin", "2x lr")))
    assert "recall: 1/1" in run.stdout and "false forecasts: 0 of 4 healthy runs" in run.stdout
    turned = rows["2x lr | noqk | 1"]["onset"] is not None  # the onset rule's own check on a healthy run
    assert f"loss onsets on healthy runs (the 2x runs against their twins): {int(turned)} of 1" in run.stdout
    assert all(rows[f"twin | noqk | {s}"]["onset"] is None for s in (1, 2, 3))
