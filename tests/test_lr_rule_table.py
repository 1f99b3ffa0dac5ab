"""The LR rule is what its saved runs fit: `benchmarks/mup_vs_sp.py --rule-table` refits it on the shapes not held
out and rebuilds docs/model.md's table of every shape from the runs saved beside it; `--shapes` records each run's
shape, and its `default` arm trains at the configs' own LR for that shape's tokens a step."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from steadylm.config import compose

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks" / "mup_vs_sp.py"
RUNS = [ROOT / "docs" / "lr_rule.jsonl", ROOT / "docs" / "mup_vs_sp.jsonl"]


def rule_table() -> str:
    return subprocess.run(
        [sys.executable, str(BENCH), "--rule-table", *map(str, RUNS)], capture_output=True, text=True, check=True
    ).stdout


def test_the_rule_is_the_fit_of_its_saved_runs_and_the_docs_table_is_theirs():
    out = rule_table()
    fit = re.search(r"lr = ([\d.e-]+) x \(width / 128\)\^([-\d.]+) x \(tokens / 2048\)\^([-\d.]+)", out)
    rule = compose().optim.lr_rule
    lr0, width_exp, tokens_exp = map(float, fit.groups())
    assert rule.lr == pytest.approx(lr0, rel=0.1)  # the configs' rule rounds the fit
    assert rule.width_exponent == pytest.approx(width_exp, abs=0.05)
    assert rule.tokens_exponent == pytest.approx(tokens_exp, abs=0.05)
    table = out[out.index("| steps |") :].strip()
    assert table in (ROOT / "docs" / "model.md").read_text()
    assert "| held out |" in table and "| fit |" in table


def test_shapes_runs_record_their_shape_and_the_default_arm_trains_at_the_rules_lr(tmp_path):
    saved = tmp_path / "runs.jsonl"
    args = ["--shapes", "64x1@2x16,64x1@4x32", "--steps", "3", "--heads", "2", "--val-windows", "4", "--seeds", "0"]
    args += ["--arms", "default", "--json", str(saved)]
    subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    rows = [json.loads(line) for line in saved.read_text().splitlines()]
    assert [(r["width"], r["layers"], r["batch"], r["context"]) for r in rows] == [(64, 1, 2, 16), (64, 1, 4, 32)]
    rule = compose().optim.lr_rule
    for r in rows:
        tokens = r["batch"] * r["context"]
        expected = rule.lr * (64 / 128) ** rule.width_exponent * (tokens / 2048) ** rule.tokens_exponent
        assert r["lr"] == float(f"{expected:.3g}")
    assert rows[1]["lr"] > rows[0]["lr"]  # 4x the tokens a step: a higher LR


def test_a_missing_rule_table_file_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCH), "--rule-table", str(tmp_path / "no.jsonl")], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stderr.strip() == f"error: --rule-table: no such file: {tmp_path / 'no.jsonl'}"
