"""Throughput/MFU logging, the peak-FLOPs table, and the benchmark script's quick mode."""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from steadylm.devices import resolve_precision
from steadylm.progress import peak_flops
from steadylm.train import train
from tests.helpers import scalars

ROOT = Path(__file__).resolve().parents[1]


def test_peak_table_knows_h200_and_h100():
    assert peak_flops("NVIDIA H200") == peak_flops("NVIDIA H100 80GB HBM3") == 989.4e12
    assert peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert peak_flops("Some Future GPU") is None


def test_auto_precision_is_bf16_only_on_a_cpu_with_bf16_units(monkeypatch):
    from steadylm import compat

    monkeypatch.delenv("STEADYLM_AUTO_PRECISION", raising=False)
    monkeypatch.setattr("steadylm.devices.cpu_has_bf16", lambda: True)
    assert resolve_precision("auto", "cpu") == "bf16-mixed"
    monkeypatch.setattr("steadylm.devices.cpu_has_bf16", lambda: False)
    assert resolve_precision("auto", "cpu") == "32-true"
    assert resolve_precision("16-mixed", "cpu") == "16-mixed"
    monkeypatch.setenv("STEADYLM_AUTO_PRECISION", "bf16-mixed")  # how the suite is run as a bf16 machine would
    assert resolve_precision("auto", "cpu") == "bf16-mixed"
    assert isinstance(compat.cpu_has_bf16(), bool)


def test_tokens_per_sec_and_mfu_are_logged(make_cfg, tmp_path):
    _, objects = train(make_cfg("callbacks.throughput.peak_flops=1e12", "trainer.max_steps=20"))
    tags = scalars(tmp_path / "run")
    tps, mfu = tags["perf/tokens_per_sec"], tags["perf/mfu"]
    assert len(tps) == len(mfu) >= 2 and all(t > 0 for t in tps)
    fpt = objects["module"].net.flops_per_token()
    for t, m in zip(tps, mfu):
        assert m == pytest.approx(t * fpt / 1e12, rel=1e-4)


def test_adamw_is_fused_on_cpu(make_cfg):
    """The CPU default is a per-tensor Python loop, ~5x slower than the fused kernel on a tiny model."""
    _, objects = train(make_cfg("trainer.max_steps=2", "optim.warmup_steps=1"))
    assert objects["trainer"].optimizers[0].defaults["fused"] is True


def test_benchmark_quick_mode_prints_every_ratio(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench.py"), "--quick", "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # progress, and no per-fit banner ("GPU available: False, used: False"; on a GPU machine Lightning also warns
    # "GPU available but not used", which is not a banner)
    assert "runs of 20 steps" in proc.stderr and "GPU available:" not in proc.stderr
    for row in (
        "Lightning + suite / raw loop",
        "suite on / suite off",
        "suite hook time",
        "data loader / training",
        "data.sources read cost / step",
        "bf16 autocast",
        "FLOPs/token",
        "Python calls per ordinary step",
    ):
        assert row in proc.stdout
    results = json.loads(out.read_text())
    for key in (
        "lightning_suite_over_raw",
        "suite_on_over_off",
        "suite_hook_share_of_step",
        "loader_over_training_tokens_per_sec",
        "bf16_over_fp32_cpu",
    ):
        assert results[key] > 0
    for low, high in results["intervals"].values():
        assert 0 < low <= high
    share, low, high = results["mixture_read_share_of_step"]
    assert low <= high and -1 < share < 10  # a difference of two medians in step units: noisy at quick sizes
    assert results["steps_timed"] >= 10  # paired Lightning/raw steps after the warm-up
    assert results["flops_per_token"] > 6 * results["params"]
    calls = results["python_calls_per_step"]  # counts, not times: each layer adds Python on top of the last
    assert 0 < calls["raw"] < calls["minimal"] < calls["suite"]
    assert 0 < calls["steadylm_files"] < calls["steadylm_functions"]  # reported, not bounded: a fork may add a check
    assert "steadylm functions an ordinary step calls: " in proc.stdout


def test_gpu_script_imports_and_refuses_without_a_gpu():
    """It never runs in CI (no GPU), so at least prove it loads and says why it stops."""
    if __import__("torch").cuda.is_available():
        pytest.skip("a GPU is visible: run benchmarks/gpu.sh instead")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py")], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 1 and "no CUDA GPU visible" in proc.stderr, proc.stderr[-2000:]


def test_gpu_script_times_a_fit_and_counts_per_step(make_cfg, monkeypatch):
    """Its fit path on the CPU: one time per step after the settling steps (its CUDA sync count has nothing to count
    here; tests/test_host_reads.py guards the host reads instead)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu

    _, times, _ = gpu.fit_and_time(make_cfg("trainer.max_steps=14", "trainer.limit_val_batches=0"))
    assert len(times) == 14 - 1 - gpu.SETTLE and all(t > 0 for t in times)


def test_benchmark_refuses_too_few_rounds_or_steps():
    for args in (["--rounds", "0"], ["--steps", "3"]):
        proc = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / "bench.py"), *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        assert proc.returncode == 2 and "--rounds must be >= 1 and --steps >= 10" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.slow
def test_gpu_script_cpu_form_times_both_recipes_to_the_default_loss():
    """gpu.sh's time-to-loss part in its CPU form: both recipes' throughput, and experiment=fast's steps to the
    default recipe's final val loss (or that it did not reach it)."""
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--cpu", "--to-loss", "--steps", "16", "--every", "8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "default: device cpu" in out and "experiment=fast: device cpu" in out and "tokens/s" in out
    assert re.search(r"  experiment=fast: (step \d+ \([\d.]+x the steps\)|not reached)", out), out


@pytest.mark.slow
def test_speedrun_bench_quick_prints_a_row_per_switch(tmp_path):
    """The contribution table's plumbing on tiny sizes: every switch composes, trains and gets a row."""
    out = tmp_path / "sr.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "speedrun_bench.py"), "--quick", "--jobs", "2", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = json.loads(out.read_text())["table"]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from speedrun_bench import SWITCHES

    assert set(table) == set(SWITCHES)
    others = [row for name, row in table.items() if name != "baseline"]
    assert all(len(row["final_delta_pct"]) == 1 and math.isfinite(row["final_delta_pct"][0]) for row in others), table
