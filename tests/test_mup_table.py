"""`benchmarks/mup_vs_sp.py --table` turns saved runs into docs/model.md's table: the means over seeds, each gap
against sp's best grid point, each seed's own gap against that seed's best, a best on the grid's edge marked, and
muP at another alpha_output in a column of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "mup_vs_sp.py"


def run(arm: str, lr: float, seed: int, loss: float, width: int = 512) -> dict:
    return dict(arm=arm, width=width, steps=300, lr=lr, seed=seed, loss=loss, parametrization="sp")


def test_table_means_seeds_and_gives_each_seeds_gap(tmp_path):
    rows = [
        run("sp", 2.5e-4, 0, 2.2), run("sp", 5e-4, 0, 2.0), run("sp", 1e-3, 0, 2.15),
        run("sp", 2.5e-4, 1, 2.3), run("sp", 5e-4, 1, 2.2), run("sp", 1e-3, 1, 2.1),
        run("default", 3.3e-4, 0, 2.02), run("default", 3.3e-4, 1, 2.31),
        run("mup", 2e-3, 0, 2.2), run("mup", 4e-3, 0, 2.4), run("mup a4", 2e-3, 0, 2.05),
        run("sp", 1e-3, 0, 3.0, width=256),
    ]  # fmt: skip
    saved = tmp_path / "runs.jsonl"
    saved.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = subprocess.run(
        [sys.executable, str(BENCH), "--table", str(saved)], capture_output=True, text=True, check=True
    ).stdout
    row = next(line for line in out.splitlines() if line.startswith("| 300 | 512 |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "0,1"
    assert cells[3].startswith("2.1000 at 5e-4 (vertex")  # the best mean, though seed 1 is best at 1e-3
    assert cells[4] == "2.1650 at 3.3e-4 (+3.1 % [+1.0, +10.0])"  # seed 1's own best is 2.1, at 1e-3
    assert cells[5] == "2.2000 (+4.8 % [+10.0])"  # mup ran seed 0 only
    assert cells[6] == "2.2000 at 2e-3 (+4.8 % [+10.0]), on the grid's edge"
    assert cells[7] == "2.0500 at 2e-3 (-2.4 % [+2.5]), one LR"  # --mup-alpha 4's own column
    assert out.splitlines()[0].endswith("| mup, α 4, best grid LR |")
    edge = next(line for line in out.splitlines() if line.startswith("| 300 | 256 |"))
    assert "(vertex 1e-3, one LR)" in edge and edge.count("not run") == 4


def test_model_md_table_is_its_saved_runs():
    """docs/model.md's muP table is what `--table` prints from the runs saved beside it, digit for digit."""
    docs = BENCH.parents[1] / "docs"
    out = subprocess.run(
        [sys.executable, str(BENCH), "--table", str(docs / "mup_vs_sp.jsonl")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out.count("\n") == 8 and out.strip() in (docs / "model.md").read_text()


def test_a_missing_table_file_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run(
        [sys.executable, str(BENCH), "--table", str(tmp_path / "nope.jsonl")], capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stderr.strip() == f"error: --table: no such file: {tmp_path / 'nope.jsonl'}"


def test_mup_alpha_runs_as_an_arm_of_its_own(tmp_path):
    """A real (tiny) comparison: --mup-alpha 4 trains muP with logits x 4/m, saved and tabled as `mup a4`."""
    saved = tmp_path / "runs.jsonl"
    args = ["--widths", "64", "--steps", "4", "--layers", "1", "--heads", "2", "--val-windows", "8", "--seeds", "0"]
    args += ["--arms", "sp,mup", "--mup-alpha", "4", "--mup-default-only", "--sp-start", "0", "--json", str(saved)]
    out = subprocess.run(
        [sys.executable, str(BENCH), *args],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    ).stdout
    rows = [json.loads(line) for line in saved.read_text().splitlines()]
    assert {r["arm"] for r in rows} == {"sp", "mup a4"} and [r["lr"] for r in rows if r["arm"] == "mup a4"] == [2e-3]
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].endswith("| mup, α 4, best grid LR |") and table[-1].endswith(", one LR |")
