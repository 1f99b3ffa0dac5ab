"""`benchmarks/model_bench.py --quick` runs end to end and reports the ratios it promises."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "model_bench.py"


def test_model_bench_quick_reports_family_and_framework_ratios(capsys):
    spec = importlib.util.spec_from_file_location("model_bench", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = bench.main(["--quick", "--rounds", "1", "--steps", "6"])
    assert set(results) == {"tiny", "llama_tiny"}
    for r in results.values():
        assert r["tokens_per_s"]["steadylm"] > 0 and r["tokens_per_s"]["raw"] > 0 and r["steadylm_over_raw"] > 0
    assert set(results["llama_tiny"]["vs_tiny"]) == {"steadylm", "raw"}
    out = capsys.readouterr().out
    assert "steadylm/raw" in out and "llama_tiny" in out
