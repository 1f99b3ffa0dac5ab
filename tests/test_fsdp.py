"""FSDP2 (`trainer=fsdp_sim`: 2 CPU processes, gloo) against DDP (`ddp_sim`) on the same config and seed, and the
stability suite under it: faults injected into a sharded run, each handled on every rank, ending where the clean run
ends; a rollback restores each rank's shards of the weights and the optimizer state exactly."""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch

from steadylm.diagnose.cli import main as diagnose_main
from steadylm.distributed import local
from steadylm.export import main as export_main
from steadylm.run_config import read_run_config
from steadylm.stability import read_events
from tests.helpers import faults, run_cli, scalars
from tests.test_eval import write_generic

# The conftest tiny model, through the command line (a strategy with a launcher needs a script to re-run).
TINY = [
    "model.n_layer=2",
    "model.d_model=64",
    "model.n_head=2",
    "model.mup_base_width=64",
    "model.mup_base_head_dim=32",
    "optim.lr_rule.width=64",
    "model.context_length=64",
    "data.batch_size=8",
    "trainer.precision=32-true",
    "trainer.enable_progress_bar=false",
]


def _run(shards_dir, tmp_path: Path, name: str, *extra: str) -> Path:
    run = tmp_path / name
    proc = run_cli(*TINY, f"data.dir={shards_dir}", f"hydra.run.dir={run}", *extra, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def _result(run: Path) -> dict:
    return json.loads((run / "result.json").read_text())


@pytest.mark.slow
def test_fsdp_sim_trains_as_ddp_sim_does_and_saves_a_distributed_checkpoint(shards_dir, tmp_path):
    """30 steps, fp32: the same train and val loss (1e-4 relative), the same pre-clip gradient norm and per-block
    stats (the norms of shards, summed as squares), the same in-loop multiple-choice scores; the checkpoint is a
    folder with each rank's shards."""
    task = write_generic(tmp_path / "mc.jsonl")
    steps = ["trainer.max_steps=30", "trainer.val_check_interval=15", "data.val_windows=16"]
    steps += ["trainer.log_every_n_steps=5", "optim.warmup_steps=5", "callbacks.checkpoint.every_n_train_steps=15"]
    steps += [f"callbacks.eval.tasks=[{task}]", "callbacks.eval.limit=12"]
    ddp = _run(shards_dir, tmp_path, "ddp", "trainer=ddp_sim", *steps)
    fsdp = _run(shards_dir, tmp_path, "fsdp", "trainer=fsdp_sim", *steps)
    for key in ("train_loss", "val_loss"):
        assert _result(fsdp)[key] == pytest.approx(_result(ddp)[key], rel=1e-4), key
    a, b = scalars(ddp), scalars(fsdp)
    for tag in ("optim/grad_norm", "stability/grad_norm/block_1", "stability/param_norm/block_0", "val/loss"):
        assert len(a[tag]) >= 2 and b[tag] == pytest.approx(a[tag], rel=1e-4), tag
    assert len(a["eval/mc/acc_norm"]) == 2 and b["eval/mc/acc_norm"] == a["eval/mc/acc_norm"]
    ckpt = fsdp / "checkpoints" / "step0000030.ckpt"
    assert ckpt.is_dir() and {"__0_0.distcp", "__1_0.distcp", ".metadata", "meta.pt"} <= {
        p.name for p in ckpt.iterdir()
    }
    assert sorted(p.name for p in ckpt.parent.iterdir()) == ["last.ckpt", "step0000030.ckpt"]  # no .tmp, .old
    log = (fsdp / "train.log").read_text()  # written asynchronously (trainer=fsdp's default), each save's stall said
    assert re.search(r"checkpoint step0000030\.ckpt: training waited [\d.]+ s \(its shards are written in the", log)


class ShardProbe(L.Callback):
    """Each rank keeps its shards of the weights and AdamW state at the start of step `step`; at the first step after
    a rollback it writes `restored<rank>.json`: the largest difference from them (0.0: restored exactly)."""

    def __init__(self, step: int):
        self.step, self.kept, self.checked = step, None, False

    @staticmethod
    def _state(trainer, pl_module) -> list[torch.Tensor]:
        opt = trainer.optimizers[0]
        moments = [local(opt.state[p][k]) for p in pl_module.parameters() for k in ("exp_avg", "exp_avg_sq")]
        return [local(p.detach()).clone() for p in pl_module.parameters()] + [m.clone() for m in moments]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step and self.kept is None:
            self.kept = self._state(trainer, pl_module)
        stability = next(c for c in trainer.callbacks if type(c).__name__ == "Stability")
        if stability.recovery.rollbacks and not self.checked:
            self.checked = True
            now = self._state(trainer, pl_module)
            diff = max(float((a - b).abs().max()) for a, b in zip(now, self.kept))
            sharded = all(isinstance(p, torch.distributed.tensor.DTensor) for p in pl_module.parameters())
            out = {"diff": diff, "sharded": sharded, "step": trainer.global_step}
            Path(trainer.default_root_dir, f"restored{trainer.global_rank}.json").write_text(json.dumps(out))


@pytest.mark.slow
def test_faults_in_a_sharded_run_are_each_handled_on_every_rank_and_end_where_the_clean_run_ends(shards_dir, tmp_path):
    """An inf gradient (skipped), a batch of random labels (logged, a one-off), a 1000x LR step (QK-clip bounds the
    broken logits, the spike is rolled back to the step-150 snapshot of every rank's shards, restored exactly)."""
    steps = ["trainer.max_steps=200", "trainer.val_check_interval=200", "data.val_windows=32"]
    steps += ["trainer.log_every_n_steps=10", "optim.warmup_steps=20", "trainer=fsdp_sim"]
    clean = _run(shards_dir, tmp_path, "clean", *steps)
    injected = faults(
        {"kind": "inf_grad", "step": 60, "param": "blocks.0.attn.qkv.weight"},
        {"kind": "corrupt_labels", "step": 100},
        {"kind": "lr_spike", "step": 150, "factor": 1000},
    )
    probe = "+callbacks.probe={_target_: test_fsdp.ShardProbe, step: 150}"
    run = _run(shards_dir, tmp_path, "faults", *steps, injected, probe)
    assert _result(run)["val_loss"] == pytest.approx(_result(clean)["val_loss"], rel=0.01)
    assert _result(clean)["status"] == "ok" and _result(run)["status"] != "diverged", _result(run)["reason"]
    events = [(e["step"], e["kind"], e["action"]) for e in read_events(run) if e["kind"] != "qk_clip"]
    assert events == [
        (60, "nonfinite_grad", "skip"),
        (100, "loss_spike", "log"),
        (151, "loss_spike", "rollback"),
        (154, "rollback", "rollback"),
        (200, "unrecovered", "log"),  # 45 steps after the restore, a hair above the best before it: cut short
    ], events
    detail = {e["kind"]: e["detail"] for e in read_events(run)}
    assert detail["nonfinite_grad"]["module"] == "blocks.0.attn.qkv"
    assert detail["rollback"]["source"] == "snapshot_file" and detail["rollback"]["to_step"] == 150
    clips = [e for e in read_events(run) if e["kind"] == "qk_clip"]
    assert clips and all(150 < e["step"] <= 154 for e in clips)  # the broken weights' logits, bounded
    for rank in (0, 1):
        restored = json.loads((run / f"restored{rank}.json").read_text())  # the first step on the restored state
        assert (restored["diff"], restored["sharded"]) == (0.0, True) and restored["step"] > 154, restored
    assert not any(e["kind"] in ("qk_clip", "loss_spike", "nonfinite_grad") for e in read_events(clean))


@pytest.mark.slow
def test_without_snapshots_a_sharded_rollback_loads_each_rank_s_shards_of_the_checkpoint_on_disk(shards_dir, tmp_path):
    """No snapshots (`recovery=null`): a NaN written into one rank's shard at step 6 is caught, and every rank loads
    its own shards of the step-4 distributed checkpoint (the newest at or before the onset), weights and AdamW state,
    exactly; the run goes on to its end."""
    steps = ["trainer=fsdp_sim", "trainer.max_steps=12", "trainer.val_check_interval=12", "data.val_windows=16"]
    steps += ["optim.warmup_steps=2", "callbacks.checkpoint.every_n_train_steps=4", "callbacks.stability.recovery=null"]
    steps += [
        "callbacks.stability.guard.max_consecutive=2",
        "+callbacks.probe={_target_: test_fsdp.ShardProbe, step: 4}",
    ]
    fault = faults({"kind": "nan_weight", "step": 6, "param": "blocks.1.mlp.fc.weight", "rank": 1})
    run = _run(shards_dir, tmp_path, "disk", *steps, fault)
    rollback = [e["detail"] for e in read_events(run) if e["kind"] == "rollback"]
    assert [(r["source"], r["checkpoint"], r["to_step"]) for r in rollback] == [("disk", "step0000004.ckpt", 4)]
    for rank in (0, 1):
        restored = json.loads((run / f"restored{rank}.json").read_text())
        assert (restored["diff"], restored["sharded"]) == (0.0, True), restored
    assert _result(run)["status"] != "diverged" and _result(run)["train_loss"] < 6, _result(run)


@pytest.mark.slow
def test_muon_under_fsdp_sim_orthogonalizes_whole_matrices_as_under_ddp_sim(shards_dir, tmp_path):
    """optim=muon with sharded matrices: each gathered whole for Newton-Schulz, then its own rows kept; 10 steps end
    where DDP's do, bitwise. Without norm clipping: the global norm of shards (a sum of their squares) rounds apart
    from DDP's in the 7th digit, and Newton-Schulz, whose quintic has slope 3.4 at 0, amplifies that in the small
    singular directions ~500x over its 5 iterations (1e-3 on the val loss after 10 clipped steps)."""
    steps = ["optim=muon", "trainer.max_steps=10", "trainer.val_check_interval=10", "data.val_windows=16"]
    steps += ["trainer.gradient_clip_val=null"]
    steps += ["trainer.log_every_n_steps=5", "optim.warmup_steps=2"]
    ddp = _run(shards_dir, tmp_path, "ddp", "trainer=ddp_sim", *steps)
    fsdp = _run(shards_dir, tmp_path, "fsdp", "trainer=fsdp_sim", *steps)
    for key in ("train_loss", "val_loss"):
        assert _result(fsdp)[key] == _result(ddp)[key], key
    assert scalars(fsdp)["stability/update_ratio"] == pytest.approx(scalars(ddp)["stability/update_ratio"], rel=1e-6)


@pytest.mark.slow
def test_a_distributed_checkpoint_resumes_bitwise_on_as_many_ranks_and_reshards_to_one_and_back(shards_dir, tmp_path):
    """8 steps of 32 windows on 2 ranks with selective activation checkpointing, saved every 2 (each a folder of
    shards). Resumed from step 4 on 2 ranks: the
    same val loss, bitwise; from step 4 on 1 rank, then that run's step 6 on 2 again: the same losses within float
    tolerance. `generate` reads a sharded checkpoint as it is."""
    steps = ["data.global_batch_tokens=2048", "trainer.max_steps=8", "trainer.val_check_interval=8"]
    steps += ["data.val_windows=16", "trainer.log_every_n_steps=2", "optim.warmup_steps=2"]
    steps += ["callbacks.checkpoint.every_n_train_steps=2", "callbacks.checkpoint.save_top_k=-1", "trainer=fsdp_sim"]
    steps += ["model.activation_checkpointing=selective"]  # FSDP2 units recomputed in backward, as on a 24 GB GPU
    full = _run(shards_dir, tmp_path, "full", *steps)
    ckpt = "checkpoints/step0000004.ckpt"
    again = _run(shards_dir, tmp_path, "again", *steps, f"ckpt_path={full / ckpt}")
    assert _result(again)["val_loss"] == _result(full)["val_loss"]
    one = _run(shards_dir, tmp_path, "one", *steps, "trainer.devices=1", f"ckpt_path={full / ckpt}")
    two = _run(shards_dir, tmp_path, "two", *steps, f"ckpt_path={one / 'checkpoints/step0000006.ckpt'}")
    for resumed in (one, two):  # the last step's train loss: its token mean over every micro-batch and rank
        assert _result(resumed)["train_loss"] == pytest.approx(_result(full)["train_loss"], rel=1e-5)
    # val: the same 4 batches a rank only on as many ranks (the count is per rank)
    assert _result(two)["val_loss"] == pytest.approx(_result(full)["val_loss"], rel=1e-5)
    out = run_cli(f"ckpt={full / ckpt}", "max_new_tokens=8", "seed=0", module="steadylm.generate", cwd=tmp_path)
    assert out.returncode == 0 and len(out.stdout) > 0, out.stderr[-2000:]
    export_main([f"ckpt={full / ckpt}", f"out={tmp_path / 'hf'}"])  # eval's path too (an export, then lm-eval)
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    (full / "config.yaml").unlink()  # diagnose falls back to the newest checkpoint's config: a folder's meta.pt
    assert read_run_config(full)["optim"]["lr"] == _result(full)["lr"]
    diagnose_main([str(full)])
    assert f"optim.lr={_result(full)['lr']}" in (full / "report.md").read_text()
