"""A shard poisoned after it was written (an id the model cannot embed, found only when its window is read):
the real `python train.py` stops with one `error:` line naming the file, the token offset and the id, exit 2,
and no traceback through torch or Lightning, whether the window is read in the main process or a worker."""

from __future__ import annotations

import shutil

import h5py
import pytest

from tests.helpers import CLI_TINY, run_cli

TINY = [
    "trainer=cpu",
    *CLI_TINY,
    "trainer.max_steps=3",
    "optim.warmup_steps=1",
    "trainer.limit_val_batches=0",
    "logger=none",
]


def poisoned_copy(shards_dir, tmp_path):
    """A copy of the test shards with id 400 at token offset 100; the attributes still say every id is < 257."""
    data = tmp_path / "shards"
    shutil.copytree(shards_dir, data)
    bad = data / "train-00000.h5"
    with h5py.File(bad, "r+") as f:
        f["tokens"][100] = 400
    return data, bad


@pytest.mark.parametrize("workers", [0, 1])
def test_poisoned_window_stops_training_with_one_line(shards_dir, tmp_path, workers):
    data, bad = poisoned_copy(shards_dir, tmp_path)
    proc = run_cli(
        *TINY,
        f"data.dir={data}",
        "data.shuffle=false",
        f"data.num_workers={workers}",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        timeout=300,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert lines[-1] == (  # model.vocab_size is null: the ids are held to the shard's own vocabulary
        f"error: {bad}: token id 400 at token offset 100 is >= the shard's vocab_size 257; the shard is "
        "corrupt or was made with another tokenizer: re-run `python -m steadylm.data.prepare`"
    ), lines
    assert [ln for ln in lines if ln.startswith("error")] == lines[-1:]


@pytest.mark.slow  # two DDP processes on CPU (gloo): ~20 s
@pytest.mark.parametrize("workers", [0, 1])
def test_poisoned_window_on_one_ddp_rank_stops_every_rank_with_its_line(shards_dir, tmp_path, workers):
    """Window 3 (offset 96..128 holds offset 100) lands on rank 1 with shuffle off: rank 0 must stop too and
    report rank 1's line, once, instead of dying in the gradient all-reduce with a gloo traceback."""
    data, bad = poisoned_copy(shards_dir, tmp_path)
    proc = run_cli(
        *TINY,
        "trainer=ddp_sim",
        f"data.dir={data}",
        "data.shuffle=false",
        f"data.num_workers={workers}",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Connection closed" not in proc.stderr, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if "error:" in ln]
    assert errors == [
        f"error: {bad}: token id 400 at token offset 100 is >= the shard's vocab_size 257; "
        "the shard is corrupt or was made with another tokenizer: re-run "
        "`python -m steadylm.data.prepare`"
    ], errors
