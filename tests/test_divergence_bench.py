"""`benchmarks/divergence_bench.py`'s pieces that decide its numbers: the repeated-data scenario's shards and the
loss's onset against the twin's seeds."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import h5py
import numpy as np

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "divergence_bench.py"
spec = importlib.util.spec_from_file_location("divergence_bench", BENCH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def tokens(folder: Path, split: str) -> np.ndarray:
    with h5py.File(folder / f"{split}-00000.h5") as f:
        return f["tokens"][:].astype(np.int64)


def test_the_repeated_data_is_the_clean_data_with_one_real_file_repeated_in_a_window_and_the_same_val(tmp_path):
    bench.data_folders(tmp_path)
    rep, clean = tokens(tmp_path / "data-repeated", "train"), tokens(tmp_path / "data-clean", "train")
    name, times = bench.REPEATED
    text = next(f for f in bench.stdlib_files() if f.name == name).read_bytes()
    stretch = np.frombuffer(text * times, dtype=np.uint8).astype(np.int64)
    at = next(i for i in range(bench.REPEAT_AT, len(rep)) if (rep[i : i + len(text)] == stretch[: len(text)]).all())
    assert bench.REPEAT_AT <= at < bench.REPEAT_AT + 20_000  # the next document boundary after REPEAT_AT
    assert (rep[at : at + len(stretch)] == stretch).all()  # contiguous: read in order, a window of ~32 steps
    rest = np.concatenate([rep[:at], rep[at + len(stretch) + 1 :]])  # less the stretch and its document end
    assert (rest == clean).all()
    assert (tokens(tmp_path / "data-repeated", "val") == tokens(tmp_path / "data-clean", "val")).all()


def write_loss(run: Path, losses: list[float]) -> Path:
    run.mkdir()
    rows = "".join(f"{5 * i},{x}\n" for i, x in enumerate(losses))
    (run / "metrics.csv").write_text("step,train/loss\n" + rows)
    return run


def test_the_onset_is_ten_percent_above_every_twin_seed_or_non_finite(tmp_path):
    fast = write_loss(tmp_path / "t1", [5, 4, 3, 3, 3, 3, 3, 3])
    twins = [fast, write_loss(tmp_path / "t2", [5, 4, 3.4, 3.4, 3.4, 3.4, 3.4, 3.4])]  # and a slower healthy seed
    seed_gap = write_loss(tmp_path / "gap", [5, 4, 3.35, 3.35, 3.35, 3.35, 3.35, 3.35])  # within the seeds
    assert bench.loss_onset(seed_gap, twins) is None
    turned = write_loss(tmp_path / "turned", [5, 4, 3, 3, 3, 4, 4, 4])
    assert bench.loss_onset(turned, twins) == 30  # the 3-point median passes 3.74 at step 30
    nan = write_loss(tmp_path / "nan", [5, 4, 3, 3, float("nan"), 3, 3, 3])
    assert bench.loss_onset(nan, twins) == 20
