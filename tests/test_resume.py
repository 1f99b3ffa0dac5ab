"""Exact resume: k steps + resume + k steps equals 2k uninterrupted steps, bitwise, on CPU."""

from __future__ import annotations

import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from steadylm.checkpointing import safe_load
from steadylm.resume import latest_checkpoint
from steadylm.train import train
from tests.helpers import fit

K = 8
# Dropout makes the loss depend on the RNG stream, so a resume that lost the RNG state shows up;
# validation every 4 steps runs right after the step-8 checkpoint, as it would in a real run.
RESUME = [
    "model.dropout=0.1",
    f"optim.total_steps={2 * K}",
    "optim.warmup_steps=3",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=4",
    "data.val_windows=16",
    "callbacks.checkpoint.every_n_train_steps=4",
]


def step_losses(run: Path) -> dict[int, float]:
    """train/loss by step from every event file in the run's TensorBoard folder."""
    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    return {e.step: e.value for e in acc.Scalars("train/loss")}


def same(a, b) -> bool:
    """Exact equality through nested dicts/lists/tuples of tensors and numbers."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def test_k_plus_resume_plus_k_equals_2k_bitwise(make_cfg, tmp_path):
    full, split = tmp_path / "full", tmp_path / "split"
    train(make_cfg(*RESUME, f"trainer.max_steps={2 * K}", out=full))
    train(make_cfg(*RESUME, f"trainer.max_steps={K}", out=split))
    first_half = step_losses(split)
    ckpt = split / "checkpoints" / "last.ckpt"
    state = safe_load(ckpt)
    assert state["global_step"] == K
    shape = {"global_batch": 8, "step_batches": 1}  # what the count means: windows per micro-batch and per step
    assert state["ShardDataModule"] == {"train_sampler": {"epoch": 0, "batches_done": K, **shape}}
    assert (
        "RNGState" in state["callbacks"] and "steadylm.stability" in state["callbacks"] and "optimizer_states" in state
    )
    assert state["steadylm"]["config"]["model"]["dropout"] == 0.1 and state["steadylm"]["tokenizer"] == "bytes"

    metrics, objects = train(make_cfg(*RESUME, f"trainer.max_steps={2 * K}", "resume=auto", out=split))
    assert objects["trainer"].global_step == 2 * K

    expected, got = step_losses(full), step_losses(split)
    assert len(expected) == 2 * K and set(got) == set(expected)
    assert {s: got[s] for s in first_half} == first_half  # the first half was not rewritten
    assert got == expected  # float32 equality: bitwise, every step before and after the resume
    assert len(list((split / "tensorboard").glob("events.out.tfevents.*"))) == 2  # appended to the same run
    a, b = safe_load(full / "checkpoints" / "last.ckpt"), safe_load(split / "checkpoints" / "last.ckpt")
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    # Callback state rode through the resume: the spike detector's rolling window, the guard's
    # counters and the RNGs end exactly as in the uninterrupted run (ModelCheckpoint holds paths).
    states = {k: v for k, v in a["callbacks"].items() if not k.startswith("ModelCheckpoint")}
    assert states["steadylm.stability"] and "RNGState" in states
    for key, state in states.items():
        assert same(state, b["callbacks"][key]), key


@pytest.mark.slow
def test_resume_without_rng_state_diverges(make_cfg, tmp_path):
    """The control for the bitwise test: drop the RNG callback and dropout draws differ after resume."""
    split = tmp_path / "split"
    train(make_cfg(*RESUME, f"trainer.max_steps={K}", out=split))
    before = step_losses(split)
    shutil.copytree(split, tmp_path / "copy")
    overrides = (*RESUME, f"trainer.max_steps={K + 2}")
    train(make_cfg(*overrides, "resume=auto", out=split))
    train(make_cfg(*overrides, "resume=auto", "~callbacks.rng_state", out=tmp_path / "copy"))
    with_rng, without = step_losses(split), step_losses(tmp_path / "copy")
    assert {s: with_rng[s] for s in before} == before == {s: without[s] for s in before}
    assert with_rng[K] != without[K]  # TensorBoard steps are 0-based: K is the first resumed step


def test_resume_auto_in_an_empty_run_dir_starts_fresh(make_cfg, tmp_path):
    _, objects = train(make_cfg("trainer.max_steps=3", "optim.warmup_steps=1", "resume=auto"))
    assert objects["trainer"].global_step == 3
    assert safe_load(latest_checkpoint(tmp_path / "run" / "checkpoints"))["global_step"] == 3


def test_init_from_starts_a_new_schedule_from_another_runs_weights(make_cfg, tmp_path):
    """`init_from`: the weights only. The optimizer, the LR schedule (warmup again from step 0), the step count and
    the data position start fresh; a changed schedule, which `ckpt_path` refuses, is the point."""
    done, first = train(make_cfg("trainer.max_steps=4", "optim.warmup_steps=1", out=tmp_path / "a"))
    ckpt = tmp_path / "a" / "checkpoints" / "last.ckpt"
    trained = {k: v.clone() for k, v in first["module"].state_dict().items()}
    restart = ["optim.lr=0.02", "optim.warmup_steps=0", "trainer.log_every_n_steps=1", f"init_from={ckpt}"]
    cfg = make_cfg("trainer.max_steps=2", *restart, out=tmp_path / "b")
    seen = []

    class Before(L.Callback):  # the weights the first update starts from
        def on_train_start(self, trainer, pl_module):
            seen.append({k: v.clone() for k, v in pl_module.state_dict().items()})

    from steadylm import train as train_module

    objects = train_module.build(cfg)
    objects["trainer"].callbacks.append(Before())
    from steadylm.resume import checkpoint_to_resume

    assert checkpoint_to_resume(cfg, objects["module"]) is None  # nothing resumed: a new run
    objects["trainer"].fit(objects["module"], datamodule=objects["datamodule"])
    assert same(seen[0], trained)
    assert objects["trainer"].global_step == 2 and objects["module"].skipped_steps == 0
    lrs = EventAccumulator(str(tmp_path / "b" / "tensorboard"))
    lrs.Reload()
    assert [e.value for e in lrs.Scalars("optim/lr")][0] == pytest.approx(0.02)  # no warmup: the new schedule's
    start = lrs.Scalars("val/loss")[0]  # the loaded weights' own, before any update: the one the first run ended at
    assert start.step == 0 and start.value == pytest.approx(done["val/loss"], abs=1e-5)


def test_init_from_under_resume_auto_continues_the_runs_own_checkpoint(make_cfg, tmp_path):
    _, first = train(make_cfg("trainer.max_steps=2", "optim.warmup_steps=1", out=tmp_path / "a"))
    other = tmp_path / "a" / "checkpoints" / "last.ckpt"
    run = ["optim.warmup_steps=1", "optim.total_steps=5", "resume=auto", f"init_from={other}"]
    train(make_cfg("trainer.max_steps=3", *run, out=tmp_path / "b"))  # no checkpoint of its own yet: init_from
    _, objects = train(make_cfg("trainer.max_steps=5", *run, out=tmp_path / "b"))  # its own last.ckpt at step 3
    assert objects["trainer"].global_step == 5
    assert safe_load(tmp_path / "b" / "checkpoints" / "last.ckpt")["global_step"] == 5


def test_latest_checkpoint_skips_partial_and_temp_files(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    good = folder / "step0000010.ckpt"
    torch.save({"state_dict": {}}, good)
    (folder / ".last.ckpt.123.tmp").write_bytes(good.read_bytes()[:50])  # a save killed mid-write
    broken = folder / "last.ckpt"
    broken.write_bytes(good.read_bytes()[:-40])  # truncated by something other than us
    assert latest_checkpoint(folder) == good


class RNGAroundValidation(L.Callback):
    """torch's global CPU generator after the training batch a validation follows, and after that validation."""

    def __init__(self) -> None:
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._batch_end: torch.Tensor | None = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._batch_end = torch.get_rng_state()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._batch_end is not None:  # not the sanity check before the first batch
            self.pairs.append((self._batch_end, torch.get_rng_state()))


def test_a_validation_never_shifts_the_training_rng_stream(make_cfg):
    """Building the val loader's iterator, and validating, draw nothing from the global generator (the loaders
    have their own): dropout after a validation sees the stream it would have seen without one."""
    seen = RNGAroundValidation()
    fit(make_cfg(*RESUME, "trainer.max_steps=8"), seen)
    assert len(seen.pairs) >= 2
    assert all(torch.equal(a, b) for a, b in seen.pairs)
