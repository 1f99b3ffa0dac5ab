"""End-to-end: the real Trainer on real shards, TensorBoard files, checkpoints, DDP, multirun."""

import math

import pytest
import torch

from steadylm.module import LMModule
from steadylm.train import train
from tests.helpers import CLI_TINY, run_cli, scalars


def test_tiny_run_learns_and_writes_tensorboard_and_checkpoint(make_cfg, tmp_path):
    cfg = make_cfg("trainer.max_steps=60", "optim.lr=3e-3")
    metrics, objects = train(cfg)
    run = tmp_path / "run"
    tags = scalars(run)
    for tag in ("train/loss", "val/loss", "optim/lr", "perf/tokens_per_sec"):
        assert tag in tags, tags.keys()
    losses = tags["train/loss"]
    assert losses[0] == pytest.approx(math.log(257), abs=0.6)  # ≈ ln(vocab) at init
    assert losses[-1] < losses[0] - 1.0  # learns on the embedded corpus
    assert objects["trainer"].global_step == 60
    ckpts = sorted((run / "checkpoints").glob("*.ckpt"))
    assert [c.name for c in ckpts] == ["last.ckpt", "step0000060.ckpt"]
    ckpt = torch.load(ckpts[0], weights_only=True)
    assert ckpt["steadylm"]["tokenizer"] == "bytes"
    assert ckpt["steadylm"]["config"]["model"]["context_length"] == 64
    assert metrics["val/loss"] < losses[0]


def test_weight_decay_only_on_matrices(make_cfg):
    from steadylm.train import build

    module = build(make_cfg())["module"]
    opt = module.configure_optimizers()
    groups = opt.param_groups  # under mup (the default): embeddings, vectors, hidden; at tiny all at optim.lr
    decay = [p for g in groups if g["weight_decay"] for p in g["params"]]
    assert {g["weight_decay"] for g in groups} == {0.1, 0.0} and all(p.dim() >= 2 for p in decay)
    assert all(p.dim() < 2 for g in groups if not g["weight_decay"] for p in g["params"])
    assert sum(map(len, (g["params"] for g in groups))) == len(list(module.parameters()))
    assert opt.defaults["betas"] == (0.9, 0.95)


@pytest.mark.parametrize(
    "targets,error,match",
    [
        (torch.zeros(2, 8), TypeError, "int64"),
        (torch.zeros(2, 8, dtype=torch.int32), TypeError, "int64"),
        (torch.zeros(2, 7, dtype=torch.long), ValueError, "shape"),
    ],
)
def test_wrong_target_dtype_or_shape_is_refused_not_cast(targets, error, match):
    module = LMModule(model=dict(n_layer=1, n_head=2, d_model=32, context_length=8, vocab_size=64), optim=dict(lr=1e-3))
    logits = module(torch.zeros(2, 8, dtype=torch.long))
    with pytest.raises(error, match=match):
        module.loss(logits, targets)


def test_all_padding_batch_gives_zero_loss_not_nan():
    module = LMModule(model=dict(n_layer=1, n_head=2, d_model=32, context_length=8, vocab_size=64), optim=dict(lr=1e-3))
    logits = module(torch.zeros(2, 8, dtype=torch.long))
    loss, _ = module.loss(logits, torch.full((2, 8), -100))
    assert loss.item() == 0.0


def test_two_process_cpu_ddp_run(shards_dir, tmp_path):
    out = tmp_path / "ddp"
    proc = run_cli(
        "trainer=cpu",
        "trainer.devices=2",
        "trainer.strategy=ddp",
        f"data.dir={shards_dir}",
        f"hydra.run.dir={out}",
        *CLI_TINY,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world_size=2" in proc.stderr + proc.stdout or "MEMBER: 2/2" in proc.stderr + proc.stdout
    assert (out / "checkpoints" / "last.ckpt").exists()
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1  # rank 0 only


def test_two_job_multirun_writes_separate_run_dirs(shards_dir, tmp_path):
    proc = run_cli("-m", "trainer=cpu", "optim.lr=1e-3,3e-3", f"data.dir={shards_dir}", *CLI_TINY, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    sweep = next((tmp_path / "logs" / "train" / "multiruns").iterdir())
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert [j.name for j in jobs] == ["0", "1"]
    lrs = [(j / ".hydra" / "overrides.yaml").read_text() for j in jobs]
    assert "optim.lr=0.001" in lrs[0] and "optim.lr=0.003" in lrs[1]
    for job in jobs:
        assert (job / "checkpoints" / "last.ckpt").exists()


def test_config_mistake_is_one_message_and_exit_2(shards_dir, tmp_path):
    proc = run_cli("model.context_length=512", "data.context_length=16", f"data.dir={shards_dir}", cwd=tmp_path)
    assert proc.returncode == 2
    assert "error: data.context_length=16 differs from model.context_length=512" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_run_the_guard_stops_exits_non_zero_naming_the_cause(shards_dir, tmp_path):
    out = tmp_path / "stopped"
    proc = run_cli(
        "trainer=cpu",
        "experiment=divergence/nan_weight",
        "callbacks.stability.guard.action=stop",
        "trainer.max_steps=30",
        "trainer.enable_progress_bar=false",
        f"data.dir={shards_dir}",
        f"hydra.run.dir={out}",
        cwd=tmp_path,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training diverged (stopped on nonfinite_loss at step 27, first in blocks.1.mlp.fc)")
    assert "steadylm.diagnose" in last
    assert (out / "checkpoints" / "step0000020.ckpt").exists()  # the last good weights are kept


def test_checkpoint_stores_each_weight_once():
    module = LMModule(model=dict(n_layer=1, n_head=2, d_model=32, context_length=8, vocab_size=64), optim=dict(lr=1e-3))
    keys = list(module.state_dict())
    assert keys and all(k.startswith("net.") for k in keys)
    assert len(keys) == len(dict(module.net.state_dict()))
