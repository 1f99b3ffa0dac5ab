"""Doctor: every check fails on a config, data or model fixture with the expected message; a healthy config passes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from steadylm.config import compose
from steadylm.data.prepare import write_shard
from steadylm.devices import Devices
from steadylm.doctor import run_checks
from steadylm.doctor.check import FAIL, OK, WARN, guarded
from steadylm.doctor.config_checks import check_schedule, config_checks
from steadylm.doctor.data_checks import data_checks
from steadylm.doctor.model_checks import (
    check_activations,
    check_backward,
    check_causal,
    grad_norm_ceiling,
    model_checks,
)
from steadylm.memory import count_params, plan
from steadylm.model.gpt import CausalSelfAttention
from steadylm.module import LMModule

ROOT = Path(__file__).resolve().parents[1]


def rows_by_name(rows):
    return {r.name: r for r in rows}


def failing(rows):
    return {r.name: r for r in rows if r.status == FAIL}


def test_healthy_config_passes_and_plots_the_lr_curve(make_cfg, tmp_path):
    rows = run_checks(make_cfg(), out_dir=tmp_path / "doc")
    assert not failing(rows), [r for r in rows if r.status != OK]
    names = {r.name for r in rows}
    for name in (
        "config: gradient clipping",
        "config: precision",
        "data: shards",
        "data: fits the model",
        "model: causal mask",
        "model: initial loss",
        "model: init grad norm",
        "model: activation RMS",
        "model: size and memory",
        "schedule: LR curve",
    ):
        assert name in names
    png = tmp_path / "doc" / "lr_schedule.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
    evidence = rows_by_name(rows)["schedule: LR curve"].evidence
    assert "peak 0.002 at step 4" in evidence
    assert "; optim.lr 0.002 from optim.lr_rule: 0.002 × (width 64 / 64)^" in evidence  # where the LR came from


def group_rows(cfg, check: str, out_dir: Path, deep: bool = False):
    """Only the group of checks `check` belongs to (the full table costs seconds per config)."""
    group = check.split(":")[0]
    if group == "config":
        return config_checks(cfg)
    if group == "data":
        return data_checks(cfg, deep)[0]
    if group == "model":
        return guarded("model: build", lambda: model_checks(cfg, None))
    return check_schedule(cfg, out_dir / "lr.png")


@pytest.mark.parametrize(
    "overrides,check,message",
    [
        (
            ["model.context_length=512", "data.context_length=16"],
            "config: context length, LR range, warmup",
            "data.context_length=16 differs from model.context_length=512",
        ),
        (["optim.min_lr=1e-2"], "config: context length, LR range, warmup", "optim.min_lr=0.01 is not allowed"),
        (["optim.warmup_steps=30"], "config: context length, LR range, warmup", "optim.warmup_steps=30 is not allowed"),
        (["trainer.gradient_clip_val=0"], "config: gradient clipping", "trainer.gradient_clip_val=0"),
        (["trainer.precision=16-true"], "config: precision", "fp16 weights with no loss scaler"),
        (["model.vocab_size=128"], "data: fits the model", "shard vocab_size 257 exceeds model.vocab_size 128"),
        (["model.init=torch_default"], "model: initial loss", "far from uniform"),
        (["trainer.max_steps=-1"], "schedule: LR curve", "trainer.max_steps=-1"),
    ],
)
def test_config_fixture_fails_its_check(make_cfg, tmp_path, overrides, check, message):
    bad = failing(group_rows(make_cfg(*overrides), check, tmp_path))
    assert check in bad, bad
    assert message in bad[check].evidence and bad[check].fix


def test_fp16_mixed_refused_on_cpu_and_total_steps_mismatch_warns(make_cfg, tmp_path):
    cfg = make_cfg("trainer.precision=16-mixed", "optim.total_steps=10")
    if not torch.cuda.is_available():
        row = rows_by_name(config_checks(cfg))["config: precision"]
        assert row.status == FAIL and "needs a CUDA GPU" in row.evidence
    sched = check_schedule(cfg, tmp_path / "lr.png")[0]
    assert sched.status == WARN and "optim.total_steps=10 but trainer.max_steps=30" in sched.evidence


def test_unpadded_vocab_warns_with_the_padded_size(make_cfg):
    row = rows_by_name(config_checks(make_cfg("model.vocab_size=300")))["config: vocab padding"]
    assert row.status == WARN and row.fix == "set model.vocab_size=320"
    assert rows_by_name(config_checks(make_cfg()))["config: vocab padding"].status == OK


@pytest.fixture
def shard_copy(shards_dir, tmp_path) -> Path:
    out = tmp_path / "shards"
    shutil.copytree(shards_dir, out)
    return out


def test_truncated_shard_is_named(make_cfg, shard_copy, tmp_path):
    path = shard_copy / "train-00000.h5"
    path.write_bytes(path.read_bytes()[:5000])
    rows = run_checks(make_cfg(f"data.dir={shard_copy}", "model.vocab_size=320"), out_dir=tmp_path)
    row = failing(rows)["data: shard train-00000.h5"]
    assert "not a readable HDF5 file" in row.evidence and "prepare" in row.fix
    assert rows_by_name(rows)["model: causal mask"].status == OK  # the model checks still run, on random tokens


def test_missing_attribute_is_named(make_cfg, shard_copy, tmp_path):
    with h5py.File(shard_copy / "val-00000.h5", "a") as f:
        del f.attrs["max_token_id"]
    bad = failing(data_checks(make_cfg(f"data.dir={shard_copy}"), deep=False)[0])
    assert "missing attribute 'max_token_id'" in bad["data: shard val-00000.h5"].evidence


def test_deep_rescan_finds_oov_ids_the_attrs_hide(make_cfg, shard_copy, tmp_path):
    with h5py.File(shard_copy / "train-00000.h5", "a") as f:
        f["tokens"][100] = 300  # > vocab 257, while the attr still says max_token_id=256
    cfg = make_cfg(f"data.dir={shard_copy}")
    assert "data: shard train-00000.h5" not in failing(data_checks(cfg, deep=False)[0])
    row = failing(data_checks(cfg, deep=True)[0])["data: shard train-00000.h5"]
    assert "train-00000.h5: token id 300 at token offset 100 is >= vocab_size 257" in row.evidence


def test_missing_val_split_and_short_shards(make_cfg, shard_copy, tmp_path):
    (shard_copy / "val-00000.h5").unlink()
    bad = failing(data_checks(make_cfg(f"data.dir={shard_copy}"), deep=False)[0])
    assert "no val shards" in bad["data: fits the model"].evidence
    write_shard(shard_copy / "val-00000.h5", np.arange(50) % 257, vocab_size=257, eos_id=256, tokenizer="bytes")
    bad = failing(data_checks(make_cfg(f"data.dir={shard_copy}"), deep=False)[0])
    assert "fewer than model.context_length + 1 = 65" in bad["data: fits the model"].evidence


class LeakyAttention(CausalSelfAttention):
    """The bug the causal check exists for: attention without the causal mask."""

    def forward(self, *args, **kwargs):
        causal = F.scaled_dot_product_attention

        def unmasked(*a, **kw):
            return causal(*a, **{**kw, "is_causal": False})

        F.scaled_dot_product_attention = unmasked
        try:
            return super().forward(*args, **kwargs)
        finally:
            F.scaled_dot_product_attention = causal


def tiny_module() -> LMModule:
    torch.manual_seed(0)
    return LMModule(model=dict(n_layer=2, n_head=2, d_model=64, context_length=64, vocab_size=320), optim=dict(lr=1e-3))


def test_model_fixtures_fail_their_checks():
    x, y = torch.randint(0, 257, (2, 64)), torch.randint(0, 257, (2, 64))
    module = tiny_module()
    assert check_causal(module.net, x)[0].status == OK
    leaky = module.net.blocks[1].attn
    module.net.blocks[1].attn = LeakyAttention(module.net.cfg)
    module.net.blocks[1].attn.load_state_dict(leaky.state_dict())
    row = check_causal(module.net, x)[0]
    assert row.status == FAIL and "attention sees the future" in row.evidence

    module = tiny_module()
    with torch.no_grad():
        module.net.wte.weight.mul_(1000)  # tied with lm_head: over-confident logits, huge gradients
    row = check_backward(module, x, y)[1]
    assert row.status == FAIL and f"outside [0.001, {grad_norm_ceiling(64, 2):.3g}] at init" in row.evidence
    assert "model.init is gpt2 already" in row.fix  # never advises the setting in use

    module = tiny_module()
    with torch.no_grad():
        module.net.blocks[1].mlp.proj.weight.mul_(1e4)
    row = check_activations(module.net, x)[0]
    assert row.status == FAIL and "blocks.1 out of band" in row.evidence
    with torch.no_grad():
        module.net.blocks[1].mlp.fc.weight[0, 0] = float("nan")
    row = check_backward(module, x, y)[0]
    assert row.status == FAIL and "non-finite weight blocks.1.mlp.fc.weight" in row.evidence


def test_memory_estimate_counts_adamw_states_per_param(tmp_path):
    cfg = compose(
        ["model=small", "trainer=cpu", "trainer.precision=32-true", "data.batch_size=8", f"paths.output_dir={tmp_path}"]
    )
    parts = plan(cfg, "32-true", Devices("cpu", 1, 1), cfg.data.batch_size, n_params=124_000_000).parts
    assert parts["weights+grads+adamw"] == 16 * 124_000_000  # fp32 weight, grad, exp_avg, exp_avg_sq
    # the default chunked loss: one chunk's logits (matmul dtype) + fp32 log-softmax + grad, the head's fp32 grad
    assert parts["logits"] == 1024 * 50304 * (4 + 8) + 50304 * 768 * 4
    assert parts["activations"] == 8 * 1024 * 12 * 34 * 768 * 2
    bf16 = plan(cfg, "bf16-mixed", Devices("cpu", 1, 1), cfg.data.batch_size, n_params=124_000_000).parts
    assert (
        bf16["activations"] == parts["activations"] // 2 and bf16["logits"] == 1024 * 50304 * (2 + 8) + 50304 * 768 * 4
    )
    cfg.optim.loss = "plain"  # every token's logits at once
    assert (
        plan(cfg, "32-true", Devices("cpu", 1, 1), cfg.data.batch_size, n_params=124_000_000).parts["logits"]
        == 8 * 1024 * 50304 * 12
    )
    assert count_params(cfg.model) == sum(
        p.numel() for p in LMModule(model=cfg.model, optim=cfg.optim).net.parameters()
    )


def run_doctor(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "STEADYLM_ROOT": str(cwd)}
    return subprocess.run(
        [sys.executable, "-m", "steadylm.doctor", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )


def test_cli_context_length_bug_is_one_line_and_exit_1(shards_dir, tmp_path):
    proc = run_doctor(
        "trainer=cpu",
        f"data.dir={shards_dir}",
        "model.context_length=512",
        "data.context_length=16",
        f"out={tmp_path / 'doc'}",
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stderr[-2000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("FAIL"))
    assert "data.context_length=16 differs from model.context_length=512" in line
    assert "Set the context length only with model.context_length" in line
    assert "Traceback" not in proc.stdout + proc.stderr
    assert (tmp_path / "doc" / "doctor.md").read_text().count("| FAIL |") == 1
    assert (tmp_path / "doc" / "lr_schedule.png").stat().st_size > 5000


@pytest.mark.parametrize(
    "override,message",
    [
        (
            "optim.lrr=1",
            "error: optim.lrr is not a config key; did you mean optim.lr or optim.lr_rule? (to add a new key on purpose, write +optim.lrr=...)",
        ),
        (
            "model=smal",
            "error: Could not find 'model/smal'; available: large, llama_1b, llama_small, llama_tiny, medium, small, tiny (see conf/)",
        ),
    ],
)
def test_cli_hydra_mistake_is_one_line_and_exit_2(override, message, tmp_path):
    proc = run_doctor(override, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == message


@pytest.mark.slow
def test_a_failed_verdict_does_not_hide_the_lr_probe(shards_dir, tmp_path, monkeypatch):
    """The memory row FAILs (a 1 MiB host) on a model that trains: the probe still runs and reports beside it."""
    monkeypatch.setattr("steadylm.memory.ram_available", lambda: 2**20)
    cfg = compose(
        [
            "trainer=cpu",
            f"data.dir={shards_dir}",
            f"paths.output_dir={tmp_path}",
            "probe.steps=8",
            "probe.max_width=64",
        ],
        config_name="doctor",
    )
    rows = run_checks(cfg, out_dir=tmp_path / "doctor")
    assert set(failing(rows)) == {"model: size and memory"}, failing(rows)
    (probe,) = [r for r in rows if r.name.startswith("lr probe")]
    assert "x1 lr" in probe.evidence, probe
