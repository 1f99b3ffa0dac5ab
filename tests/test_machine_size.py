"""A run is a function of its config, not of the machine: with `data.global_batch_tokens` set, optimizer step k trains
on the same windows on 1 rank or 2, and a checkpoint resumes on another number of ranks with no window repeated or
skipped (window ids recorded per rank by a callback) and the loss of the uninterrupted run."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import lightning as L
import pytest

from steadylm.data.sampler import EpochBatchSampler
from tests.helpers import CLI_TINY, DDP_TWO_CPU, run_cli


def _steps(n: int, B: int, W: int, A: int, epoch: int = 0) -> list[list[int]]:
    """Every optimizer step's windows over all ranks, sorted (padding dropped), for W ranks at accumulation A."""
    per_rank = []
    for r in range(W):
        s = EpochBatchSampler(n, B, rank=r, world_size=W, seed=11, step_batches=A)
        s.set_epoch(epoch)
        per_rank.append(list(s))
    micro = len(per_rank[0])
    assert micro % A == 0  # an epoch is whole optimizer steps on every machine
    steps = [[] for _ in range(micro // A)]
    for batches in per_rank:
        for i, batch in enumerate(batches):
            steps[i // A] += [w for w in batch if w != -1]
    return [sorted(s) for s in steps]


@pytest.mark.parametrize("n", [64, 101, 7])
def test_step_k_has_the_same_windows_whatever_the_ranks_and_accumulation(n):
    # 16 windows a step: 1 rank x 4 x 4 micro-batches, 2 x 4 x 2, 4 x 4 x 1, 2 x 2 x 4.
    shapes = [(4, 1, 4), (4, 2, 2), (4, 4, 1), (2, 2, 4)]
    for epoch in (0, 1):
        steps = [_steps(n, B, W, A, epoch) for B, W, A in shapes]
        assert all(s == steps[0] for s in steps[1:])
        assert sorted(w for step in steps[0] for w in step) == list(range(n))  # every window once an epoch


def test_a_count_from_another_shape_resumes_at_its_window_position():
    two_ranks = EpochBatchSampler(100, 4, world_size=2, seed=3, step_batches=1)  # 8 windows a step
    one_rank = EpochBatchSampler(100, 4, world_size=1, seed=3, step_batches=2)  # 8 windows a step
    assert one_rank.resume_batch({"epoch": 0, "batches_done": 5, **two_ranks.shape()}) == (10, None)
    assert two_ranks.resume_batch({"epoch": 0, "batches_done": 10, **one_rank.shape()}) == (5, None)
    wider = EpochBatchSampler(100, 4, world_size=3, seed=3, step_batches=1)  # 12 windows a step: another order
    start, line = wider.resume_batch({"epoch": 0, "batches_done": 5, **two_ranks.shape()})  # window 40
    assert start == 4 and "continuing at window 40 of epoch 0, skipping 8 to start a whole step" in line
    assert "set data.global_batch_tokens" in line


class WindowLog(L.Callback):
    """Each rank appends `{step, windows}` per training micro-batch to `windows<rank>.jsonl` in its run dir."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        ids = [w for w in trainer.datamodule.window_ids(batch_idx) if w != -1]
        with Path(trainer.default_root_dir, f"windows{trainer.global_rank}.jsonl").open("a") as f:
            f.write(json.dumps({"step": trainer.global_step, "windows": ids}) + "\n")


def _windows(run: Path) -> dict[int, list[int]]:
    """Optimizer step (0-based) -> the windows all ranks trained on at it, sorted."""
    steps = defaultdict(list)
    for path in run.glob("windows*.jsonl"):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            steps[row["step"]] += row["windows"]
    return {k: sorted(v) for k, v in sorted(steps.items())}


# 1 rank x 4 windows x 2 micro-batches = 2 ranks x 4 x 1 = 8 windows (256 tokens) a step.
RUN = [
    *CLI_TINY,
    "data.global_batch_tokens=256",
    "trainer.max_steps=8",
    "trainer.val_check_interval=4",
    "callbacks.checkpoint.every_n_train_steps=4",
    "callbacks.checkpoint.save_top_k=-1",
    "trainer.precision=32-true",
    "data.val_windows=13",  # a bound that no batch divides: the same 13 windows on 1 rank or 2, at any micro-batch
    "+callbacks.windows._target_=test_machine_size.WindowLog",
]


def _run(shards_dir, tmp_path: Path, name: str, ranks: int, *extra: str) -> tuple[Path, str]:
    run = tmp_path / name
    trainer = DDP_TWO_CPU if ranks == 2 else ["trainer=cpu"]
    proc = run_cli(*trainer, *RUN, f"data.dir={shards_dir}", f"hydra.run.dir={run}", *extra, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run, proc.stderr


def _val_loss(run: Path) -> float:
    return json.loads((run / "result.json").read_text())["val_loss"]


@pytest.mark.slow
def test_a_checkpoint_resumes_on_another_number_of_ranks_with_the_same_windows_and_loss(shards_dir, tmp_path):
    one, _ = _run(shards_dir, tmp_path, "one", 1)
    two, _ = _run(shards_dir, tmp_path, "two", 2)
    full = _windows(one)
    assert list(full) == list(range(8)) and all(len(w) == 8 == len(set(w)) for w in full.values())
    assert _windows(two) == full  # the same config on 1 and 2 ranks trains on the same global batches
    assert _val_loss(two) == pytest.approx(_val_loss(one), abs=1e-4)
    wide, _ = _run(shards_dir, tmp_path, "wide", 1, "data.batch_size=8")  # 8 windows x 1 micro-batch, not 4 x 2
    assert _windows(wide) == full and _val_loss(wide) == pytest.approx(_val_loss(one), abs=1e-4)

    ckpt = "checkpoints/step0000004.ckpt"
    down, _ = _run(shards_dir, tmp_path, "down", 1, f"ckpt_path={two / ckpt}")  # 2 ranks -> 1
    up, _ = _run(shards_dir, tmp_path, "up", 2, f"ckpt_path={one / ckpt}")  # 1 rank -> 2
    for resumed in (down, up):
        assert _windows(resumed) == {k: v for k, v in full.items() if k >= 4}  # steps 4..7, nothing again or skipped
        assert _val_loss(resumed) == pytest.approx(_val_loss(one), abs=1e-4)


@pytest.mark.slow
def test_a_resume_that_cannot_keep_the_order_says_so_and_repeats_nothing(shards_dir, tmp_path):
    """Without global_batch_tokens, 2 ranks (8 windows a step) resumed on 1 (4 a step): the order changes, said in
    one line, and the resumed run reads on from window 32 of the epoch, the windows the first 4 steps did not read."""
    plain = [o for o in RUN if not o.startswith("data.global_batch_tokens")]
    two = tmp_path / "two"
    proc = run_cli(*DDP_TWO_CPU, *plain, f"data.dir={shards_dir}", f"hydra.run.dir={two}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = tmp_path / "one"
    ckpt = two / "checkpoints" / "step0000004.ckpt"
    args = ["trainer=cpu", *plain, f"data.dir={shards_dir}", f"hydra.run.dir={one}", f"ckpt_path={ckpt}"]
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if "resume: the checkpoint's steps took 8 windows" in line]
    assert len(lines) == 1, proc.stdout[-3000:]
    assert "this run's take 4 (4 x 1)" in lines[0] and "continuing at window 32 of epoch 0" in lines[0]
    steps = _windows(two)
    after = sorted(w for ws in _windows(one).values() for w in ws)
    assert after == sorted(steps[4] + steps[5])  # epoch positions 32..47, as the 2-rank run read them on
    assert not set(after) & {w for k in range(4) for w in steps[k]}
