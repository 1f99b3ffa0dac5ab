"""Survive by default: each fault injected once into a default run ends where the clean run ends; actions
escalate and are bounded; a run that ends broken is `diverged`; healthy runs raise nothing."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from steadylm.result import divergence
from steadylm.stability import read_events
from steadylm.stability.suspects import read_suspects, window_text
from tests.helpers import CLI_TINY, DDP_TWO_CPU, faults, fit, run_cli

ROOT = Path(__file__).resolve().parents[1]
# The conftest tiny model, long enough that the loss curve has flattened when the fault hits.
LONG = [
    "trainer.max_steps=300",
    "trainer.val_check_interval=300",
    "data.val_windows=64",
    "trainer.log_every_n_steps=10",
    "optim.warmup_steps=20",
    "callbacks.checkpoint.every_n_train_steps=100000",
]
FAULTS = {
    "lr_spike": {"kind": "lr_spike", "step": 150, "factor": 1000},
    "inf_grad": {"kind": "inf_grad", "step": 150, "param": "blocks.0.attn.qkv.weight"},
    "corrupt_labels": {"kind": "corrupt_labels", "step": 150},
}


def val_loss(objs) -> float:
    return objs["trainer"].callback_metrics["val/loss"].item()


def test_each_fault_injected_once_into_a_default_run_ends_within_1_percent_of_the_clean_run(make_cfg, tmp_path):
    """Measured +0.16 % (lr_spike), -0.06 % (inf_grad), -0.03 % (corrupt_labels): the README's figures."""
    clean = val_loss(fit(make_cfg(*LONG, out=tmp_path / "clean")))
    for name, spec in FAULTS.items():
        out = tmp_path / name
        objs = fit(make_cfg(*LONG, faults(spec), out=out))
        assert val_loss(objs) == pytest.approx(clean, rel=0.01), name
        events = [(e["step"], e["kind"], e["action"]) for e in read_events(out)]
        detail = {e["kind"]: e["detail"] for e in read_events(out)}
        assert divergence({"val/loss": val_loss(objs)}, out) is None, name
        if name == "lr_spike":  # the weights are broken after step 150: the spike persists, rolled back from memory
            # QK-clip bounds the broken weights' logits until the rollback undoes them (steps 151-154: step 154's
            # clip comes before its deferred verdict); the logits measured on the abandoned weights in the step
            # the rollback happens in (155) never clip the restored ones.
            assert all(150 < s <= 154 for s, kind, _ in events if kind == "qk_clip"), events
            events = [e for e in events if e[1] != "qk_clip"]
            assert events == [(151, "loss_spike", "rollback"), (154, "rollback", "rollback")], events
            assert detail["rollback"]["source"] == "snapshot_file" and detail["rollback"]["to_step"] == 150
            assert detail["loss_spike"]["cause"] == "update", detail["loss_spike"]
        elif name == "inf_grad":
            assert events == [(150, "nonfinite_grad", "skip")]
            assert detail["nonfinite_grad"]["module"] == "blocks.0.attn.qkv"  # the only non-finite gradient
        else:  # one batch of random labels: a one-off, the loss comes back at once
            assert events == [(150, "loss_spike", "log")]
            assert detail["loss_spike"]["cause"] == "data"
            rows = [r for r in read_suspects(out) if r["step"] == 150]
            assert len(rows) == 8 and rows == sorted(rows, key=lambda r: -r["loss"])
            assert {"shard", "start", "end", "loss", "preview", "rank"} <= set(rows[0])


def test_a_broken_run_under_log_only_ends_diverged_with_the_last_good_state_beside_the_broken_one(make_cfg, tmp_path):
    out = tmp_path / "run"
    # Nothing else may act either: a QK-clip or precursor-signal rewind would repair these weights.
    log_only = [
        "callbacks.stability.spike.action=log",
        "callbacks.stability.qk_clip=null",
        "callbacks.stability.signals=null",
    ]
    objs = fit(make_cfg(*LONG, *log_only, faults(FAULTS["lr_spike"])))
    stop = [e for e in read_events(out) if e["action"] == "stop"]
    assert [e["detail"]["kind"] for e in stop] == ["final_loss"]
    reason = divergence({"val/loss": val_loss(objs)}, out)
    assert reason is not None and "above the run's best" in reason
    assert (out / "checkpoints" / "last_good.ckpt").is_file() and (out / "checkpoints" / "diverged.ckpt").is_file()


def test_a_transient_nan_activation_names_no_module(make_cfg, tmp_path):
    from tests.helpers import FAST

    fit(make_cfg(*FAST, faults({"kind": "nan_activation", "step": 6, "module": "blocks.1.mlp"})))
    events = read_events(tmp_path / "run")
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [(6, "nonfinite_loss", "skip")]
    assert events[0]["detail"]["module"] is None
    assert events[0]["detail"]["evidence"] == "transient: not reproduced on re-run"


@pytest.mark.parametrize("optim", [[], ["optim=muon", "optim.muon.lr_mult=2"]], ids=["adamw", "muon"])
def test_repeated_rollbacks_escalate_then_stop_every_rank_past_the_budget(make_cfg, tmp_path, optim):
    out = tmp_path / "run"
    spikes = [{"kind": "lr_spike", "step": s, "factor": 1000} for s in (60, 70, 90, 120)]
    objs = fit(
        make_cfg(
            *LONG,
            *optim,
            "trainer.max_steps=140",
            "callbacks.stability.recovery.every_n_steps=10",
            "callbacks.stability.recovery.max_rollbacks=3",
            faults(*spikes),
        )
    )
    rollbacks = [e["detail"] for e in read_events(out) if e["kind"] == "rollback"]
    assert [r["strikes"] for r in rollbacks] == [1, 2, 3]
    assert "skip_more_steps" not in rollbacks[0] and rollbacks[1]["skip_more_steps"] == 10
    assert rollbacks[2]["lr_scale"] == 0.5
    # The last update's LR, per unit of each group's multiplier (Muon's 2): one value, under half the peak (the
    # schedule alone is still at ~0.8 of it here), so the backoff reached every group, Muon's included.
    groups = objs["trainer"].optimizers[0].param_groups
    per_unit = {g["lr"] / g.get("lr_mult", 1.0) for g in groups}
    assert len(per_unit) == 1 and per_unit.pop() < 0.5 * objs["module"].optim_cfg["lr"]
    assert {g.get("lr_mult", 1.0) for g in groups} == ({1.0, 2.0} if optim else {1.0})
    stop = [e for e in read_events(out) if e["action"] == "stop" and e["kind"] == "stop"]
    assert len(stop) == 1 and "budget" in stop[0]["detail"]["reason"]
    assert objs["trainer"].global_step < 140  # stopped early, every rank at the same step
    assert (out / "checkpoints" / "last_good.ckpt").is_file()
    assert all(math.isfinite(p.detach().abs().max().item()) for p in objs["module"].parameters())
    assert "budget" in divergence({}, out)


def poison(shards: Path, out: Path, every: int, T: int, seed: int = 0) -> set[int]:
    """A copy of `shards` with every `every`-th window of the first train shard overwritten by random non-ASCII
    bytes (garbage no source file holds)."""
    shutil.copytree(shards, out)
    shard = sorted(out.glob("train-*.h5"))[0]
    rng = np.random.default_rng(seed)
    with h5py.File(shard, "r+") as f:
        tokens = f["tokens"]
        n = (len(tokens) - 1) // T
        bad = set(range(every // 2, n, every))
        for w in bad:
            tokens[w * T : (w + 1) * T + 1] = rng.integers(128, 256, T + 1).astype(tokens.dtype)
    return bad


def test_at_each_spike_a_poisoned_window_is_ranked_first_and_its_text_can_be_printed(make_cfg, shards_dir, tmp_path):
    T = 64
    bad = poison(shards_dir, tmp_path / "poisoned", every=401, T=T)
    out = tmp_path / "run"
    # One garbage window among 4 moves the batch loss by ~0.4 nats: a lower bar than the default makes it a spike.
    fit(
        make_cfg(
            f"data.dir={tmp_path / 'poisoned'}",
            *LONG,
            "trainer.max_steps=200",
            "data.batch_size=4",
            "optim.lr=3e-3",  # the loss this test's spike bar was set against
            "callbacks.stability.spike.sigma=3",
            "callbacks.stability.spike.warmup=12",
            out=out,
        )
    )
    spikes = [e for e in read_events(out) if e["kind"] == "loss_spike"]
    assert spikes, "the poisoned windows caused no spike"
    rows = read_suspects(out)
    for e in spikes:
        ranked = [r for r in rows if r["step"] == e["step"]]
        assert ranked and ranked[0]["window"] in bad, (e["step"], ranked[:3])
    top = [r for r in rows if r["step"] == spikes[0]["step"]][0]
    text = window_text(tmp_path / "poisoned" / top["shard"], top["start"], top["end"])
    assert text.startswith(top["preview"][:20])
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "steadylm.diagnose.window",
            f"data.dir={tmp_path / 'poisoned'}",
            f"shard={top['shard']}",
            f"start={top['start']}",
            f"end={top['end']}",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and proc.stdout.startswith(top["preview"][:20]), proc.stderr


HEALTHY_GRID = [
    (seed, bs, layers) for seed in (1, 2, 3) for bs, layers in ((4, 2), (4, 12), (16, 8), (64, 2), (64, 12))
]
# Muon, one seed: the noisiest batch at the largest depth, and the largest batch (the 15-run grid costs ~10 min).
MUON_GRID = [(1, 4, 12), (1, 64, 2)]


@pytest.mark.slow
@pytest.mark.parametrize(
    "optim,seed,bs,layers",
    [("adamw", *run) for run in HEALTHY_GRID] + [("muon", *run) for run in MUON_GRID],
    ids=lambda v: str(v),
)
def test_healthy_default_runs_raise_no_event_at_any_batch_size_or_depth(make_cfg, tmp_path, optim, seed, bs, layers):
    """One run per case, so the workers share the grid."""
    out = tmp_path / f"s{seed}-b{bs}-l{layers}"
    objs = fit(
        make_cfg(
            f"optim={optim}",
            f"seed={seed}",
            f"data.batch_size={bs}",
            f"model.n_layer={layers}",
            "model.d_model=32",
            "model.n_head=2",
            "model.context_length=32",
            "trainer.max_steps=250",
            "trainer.limit_val_batches=0",
            "trainer.log_every_n_steps=10",
            "optim.warmup_steps=30",
            "callbacks.checkpoint.every_n_train_steps=100000",
            out=out,
        )
    )
    assert read_events(out) == [], read_events(out)
    assert objs["module"].skipped_steps == 0


def test_two_process_ddp_rolls_back_every_rank_together_from_its_own_snapshot_files(shards_dir, tmp_path):
    """A persisting spike (an LR blow-up at step 30) rolls both ranks back to the same snapshot: identical weights."""
    import json

    out = tmp_path / "ddp"
    out.mkdir()
    proc = run_cli(
        *DDP_TWO_CPU,
        *CLI_TINY,
        f"data.dir={shards_dir}",
        f"hydra.run.dir={out}",
        "trainer.max_steps=48",
        "optim.warmup_steps=5",
        "trainer.limit_val_batches=0",
        "trainer.log_every_n_steps=8",
        "callbacks.stability.spike.warmup=12",
        "callbacks.stability.recovery.every_n_steps=10",
        "callbacks.checkpoint.every_n_train_steps=1000",
        faults({"kind": "lr_spike", "step": 30, "factor": 1000}),
        f"+callbacks.hash={{_target_: tests.helpers.ParamHash, out: {out}}}",
        cwd=tmp_path,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # the same snapshot restored on both ranks, the same steps skipped
    rollback = [e["detail"] for e in read_events(out) if e["kind"] == "rollback"]
    assert len(rollback) == 1 and rollback[0]["source"] == "snapshot_file" and rollback[0]["to_step"] == 30
