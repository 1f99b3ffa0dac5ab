"""The stability suite on the real Trainer: inject each fault, assert detection, the named cause, intact state."""

from __future__ import annotations

import copy
import json
import math
from collections import deque
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

from steadylm.stability import read_events
from steadylm.stability.measure import Measurement
from steadylm.stability.spike import SpikeDetector
from tests.helpers import CLI_TINY, DDP_TWO_CPU, FAST, Snapshot, StateByStep, faults, fit, run_cli, same_tensors

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "same-step"])
def test_inf_grad_skips_exactly_that_step_and_leaves_weights_and_adam_bitwise_untouched(make_cfg, tmp_path, defer):
    snap = Snapshot(step=6)
    cfg = make_cfg(
        *FAST,
        f"callbacks.stability.defer={defer}",
        faults({"kind": "inf_grad", "step": 6, "param": "blocks.0.attn.qkv.weight"}),
    )
    objs = fit(cfg, snap)
    events = read_events(tmp_path / "run")
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [(6, "nonfinite_grad", "skip")]
    assert events[0]["detail"]["module"] == "blocks.0.attn.qkv"
    assert len(events[0]["detail"]["batch"][0]) == 4  # the data windows of that step, for the record
    for name, p in snap.before["params"].items():
        assert torch.equal(p, snap.after["params"][name]), name  # no update, no weight decay
    for i, state in snap.before["adam"].items():
        for k, v in state.items():
            assert torch.equal(v, snap.after["adam"][i][k]), (i, k)  # moments and step count untouched
    assert objs["module"].skipped_steps == 1 and objs["trainer"].global_step == 12
    lr = objs["module"].schedule
    assert lr.warmup_steps == 5
    # The schedule did not advance on the skipped step: update 7 uses the LR step 6 would have used.
    assert snap.lrs[5] == lr(5) and snap.lrs[7] == lr(6) and snap.lrs[8] == lr(7)

    clean = fit(make_cfg(*FAST, out=tmp_path / "clean"))
    final = objs["trainer"].callback_metrics["train/loss"].item()
    assert final == pytest.approx(clean["trainer"].callback_metrics["train/loss"].item(), rel=0.05)


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_nan_weight_is_named_skipped_then_rolled_back_to_last_good_checkpoint(make_cfg, tmp_path, optim):
    cfg = make_cfg(
        *FAST,
        f"optim={optim}",
        "callbacks.stability.guard.max_consecutive=2",
        faults({"kind": "nan_weight", "step": 6, "param": "blocks.1.mlp.fc.weight"}),
    )
    states = StateByStep()
    objs = fit(cfg, states)
    events = read_events(tmp_path / "run")
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [
        (6, "nonfinite_loss", "skip"),
        (7, "nonfinite_loss", "rollback"),
        (7, "rollback", "rollback"),
    ]
    assert all(e["detail"]["module"] == "blocks.1.mlp.fc" for e in events)
    assert events[-1]["detail"]["to_step"] == 4
    module = objs["module"]
    assert all(p.isfinite().all() for p in module.parameters())
    assert module.skipped_steps == 8 - 4  # steps 4..7 are not in the weights
    assert math.isfinite(objs["trainer"].callback_metrics["train/loss"].item())
    # The rollback lands in step 7, whose update is dropped: after it the weights and the whole optimizer state
    # (AdamW moments and step counts; Muon's momentum) are step 4's, bitwise; at its start they were not.
    assert same_tensors(states.end[7], states.start[4]) and not same_tensors(states.start[7], states.start[4])


@pytest.mark.parametrize("defer", [True, False], ids=["deferred", "same-step"])
def test_nan_weight_with_stop_halts_every_rank_and_writes_forensics(make_cfg, tmp_path, defer):
    cfg = make_cfg(
        *FAST,
        "callbacks.stability.guard.max_consecutive=2",
        "callbacks.stability.guard.action=stop",
        f"callbacks.stability.defer={defer}",
        faults({"kind": "nan_weight", "step": 5, "param": "blocks.1.mlp.fc.weight"}),
    )
    objs = fit(cfg)
    # Stopped right after the second skip; deferred, the host learns of it while step 7 runs, and drops that too.
    assert objs["trainer"].global_step == (8 if defer else 7)
    assert objs["module"].skipped_steps == (3 if defer else 2)
    events = read_events(tmp_path / "run")
    assert [(e["step"], e["kind"]) for e in events] == [(5, "nonfinite_loss"), (6, "nonfinite_loss"), (6, "stop")]
    assert events[-1]["detail"]["module"] == "blocks.1.mlp.fc"
    bundle = json.loads((tmp_path / "run" / "stability" / "forensics" / "step_6.json").read_text())
    assert bundle["forward"] == "blocks.1.mlp.fc" and bundle["streak_start"] == 5
    assert bundle["layers"]["blocks.1.mlp.fc"]["param_nonfinite"] is True
    assert bundle["layers"]["blocks.0.mlp.fc"]["out_nonfinite"] == 0
    assert len(bundle["batch"][0]) == 4


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_random_labels_fire_the_loss_spike_detector_at_that_step(make_cfg, tmp_path, optim):
    cfg = make_cfg(
        *FAST,
        f"optim={optim}",
        "trainer.max_steps=30",
        "optim.lr=1e-2",
        "callbacks.stability.spike.window=12",
        "callbacks.stability.spike.warmup=8",
        faults({"kind": "corrupt_labels", "step": 26}),
    )
    fit(cfg)
    spikes = [(e["step"], e["detail"]["value"]) for e in read_events(tmp_path / "run") if e["kind"] == "loss_spike"]
    assert [s for s, _ in spikes] == [26] and spikes[0][1] > 5.0  # ~ln(vocab) on random labels


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_lr_times_1000_for_one_step_raises_the_update_ratio_alarm(make_cfg, tmp_path, optim):
    cfg = make_cfg(*FAST, f"optim={optim}", faults({"kind": "lr_spike", "step": 7, "factor": 1000}))
    fit(cfg)
    events = read_events(tmp_path / "run")
    ratio = [e for e in events if e["kind"] == "update_ratio"]
    assert [e["step"] for e in ratio] == [7]  # step 7 is a stats step: (7 + 1) % 4 == 0
    assert ratio[0]["detail"]["value"] > 1.0


def loss_bar(det: SpikeDetector) -> float:
    """The bar `det.verdict` judges the loss by now: the threshold of the episode a huge loss opens (on a copy)."""
    probe = copy.deepcopy(det)
    probe.verdict(Measurement(0, 1e300, 1.0, False, False), SimpleNamespace(world_size=1))
    return probe.episode["bar"]


def test_spike_detector_state_survives_a_round_trip():
    det = SpikeDetector(window=4, warmup=2)
    for v in (1.0, 2.0, 3.0, 4.0, 5.0):
        det.stats["loss"].append(v)
    state = json.loads(json.dumps(det.state_dict()))  # plain types: safe for weights_only checkpoints
    other = SpikeDetector(window=4, warmup=2)
    other.load_state_dict(state)
    assert list(other.stats["loss"]) == [2.0, 3.0, 4.0, 5.0]
    assert loss_bar(other) == pytest.approx(loss_bar(det))


def test_the_spike_bar_is_median_plus_sigma_robust_scales_of_log_loss_never_under_the_noise_floor():
    det = SpikeDetector(window=8, warmup=2, sigma=1.0, noise_floor=1e-9)
    det.stats["loss"] = deque([0.0, 0.1, -0.1, 0.2, -0.2, 0.0, 5.0], maxlen=8)  # one wild value moves neither
    assert loss_bar(det) == pytest.approx(math.exp(1.4826 * 0.1))  # median 0 nor MAD 0.1 much
    det = SpikeDetector(window=8, warmup=2, sigma=6.0, noise_floor=0.1)
    det.stats["loss"] = deque([math.log(2.0)] * 8, maxlen=8)  # a flat loss: MAD 0, the floor sets the bar
    det.sequences = 4
    assert loss_bar(det) == pytest.approx(2.0 * math.exp(6.0 * 0.1 / 2))
    det.sequences = 64
    assert loss_bar(det) == pytest.approx(2.0 * math.exp(6.0 * 0.1 / 8))  # a bigger batch is less noisy


def test_fp16_with_an_absurd_loss_scale_counts_skipped_steps_and_alarms(make_cfg, tmp_path):
    # Lightning turns `trainer.precision=16-mixed` into bf16 on CPU; the fp16 plugin is what a GPU gets.
    cfg = make_cfg(
        *FAST, "callbacks.stability.loss_scale.streak=4", faults({"kind": "loss_scale", "step": 0, "value": 2.0**60})
    )
    objs = fit(cfg, precision_plugin=MixedPrecision("16-mixed", "cpu"))
    events = read_events(tmp_path / "run")
    streak = [e for e in events if e["kind"] == "fp16_skip_streak"]
    assert [e["step"] for e in streak] == [3] and streak[0]["detail"]["consecutive"] == 4
    assert not any(e["kind"].startswith("nonfinite") for e in events)  # overflow is the scaler's business
    skipped = objs["module"].skipped_steps
    assert skipped >= 6  # every step overflows until the scale has halved down from 2**60
    scaler = objs["trainer"].precision_plugin.scaler
    assert scaler.get_scale() == 2.0 ** (60 - skipped)


def test_attention_logit_alarm_fires_without_qk_norm_at_lr_0_1_and_stays_quiet_with_it(make_cfg, tmp_path):
    def alarms(*overrides, out):
        fit(
            make_cfg(
                *FAST, "optim.lr=0.1", "trainer.max_steps=24", "callbacks.stability.spike=null", *overrides, out=out
            )
        )
        return [e for e in read_events(out) if e["kind"] == "attn_logit"]

    assert alarms("model.qk_norm=false", out=tmp_path / "plain")
    assert alarms("model.qk_norm=true", out=tmp_path / "qk") == []


def test_two_process_ddp_nan_loss_on_rank_1_skips_the_same_step_on_both_ranks(shards_dir, tmp_path):
    out = tmp_path / "ddp"
    out.mkdir()
    hooks = (
        "+callbacks.faults={_target_: steadylm.stability.faults.FaultInjector, faults: ["
        "{kind: nan_loss, step: 3, rank: 1}, {kind: inf_grad, step: 5, rank: 1, param: wte.weight}]}"
    )
    proc = run_cli(
        *DDP_TWO_CPU,
        *CLI_TINY,
        f"data.dir={shards_dir}",
        f"hydra.run.dir={out}",
        "trainer.max_steps=8",
        "trainer.limit_val_batches=0",
        "trainer.log_every_n_steps=4",
        hooks,
        f"+callbacks.hash={{_target_: tests.helpers.ParamHash, out: {out}}}",
        cwd=tmp_path,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1]  # identical weights: both ranks skipped the same steps
    assert ranks[0]["skipped"] == 2 and ranks[0]["step"] == 8
    events = read_events(out)
    # Step 5's inf exists on rank 1 only, after DDP's all-reduce: only the reduced flag can skip rank 0 too.
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [
        (3, "nonfinite_loss", "skip"),
        (5, "nonfinite_grad", "skip"),
    ]


def test_debug_anomaly_raises_naming_the_first_non_finite_module(make_cfg):
    from steadylm.stability.anomaly import NonFiniteError

    cfg = make_cfg(*FAST, "debug=anomaly", faults({"kind": "nan_weight", "step": 2, "param": "blocks.1.mlp.fc.weight"}))
    with pytest.raises(NonFiniteError, match=r"non-finite output in module blocks\.1\.mlp\.fc at step 2"):
        fit(cfg)


@pytest.mark.slow
def test_a_healthy_default_run_of_300_steps_raises_no_alarm(make_cfg, tmp_path):
    tiny = ["model.n_head=4", "model.d_model=128", "model.context_length=128", "data.batch_size=16"]  # model=tiny as is
    objs = fit(
        make_cfg(
            *tiny,
            "trainer.max_steps=300",
            "trainer.val_check_interval=300",
            "optim.warmup_steps=30",
            "trainer.log_every_n_steps=10",
            "callbacks.checkpoint.every_n_train_steps=100",
        )
    )
    assert read_events(tmp_path / "run") == []
    assert objs["module"].skipped_steps == 0
    assert objs["trainer"].callback_metrics["train/loss"].item() < 3.0


def lr_sensitivity(make_cfg, tmp_path, init: str) -> tuple[float, dict[float, float]]:
    """Wortsman et al. 2023: E over log-spaced LRs of min(L(lr), L_init) - min_lr L(lr)."""
    final, l_init = {}, math.log(320)
    for lr in (1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1):
        objs = fit(
            make_cfg(
                "trainer.max_steps=120",
                "trainer.val_check_interval=120",
                "optim.warmup_steps=20",
                f"optim.lr={lr}",
                f"optim.min_lr={lr / 10}",
                f"model.init={init}",
                "callbacks.stability.spike=null",
                out=tmp_path / f"{init}-{lr}",
            )
        )
        loss = objs["trainer"].callback_metrics["val/loss"].item()
        final[lr] = loss if math.isfinite(loss) else l_init
    best = min(final.values())
    return sum(min(v, l_init) - best for v in final.values()) / len(final), final


@pytest.mark.slow
def test_lr_sensitivity_of_the_default_recipe_is_at_most_half_a_nat(make_cfg, tmp_path):
    gpt2, curve = lr_sensitivity(make_cfg, tmp_path, "gpt2")
    xavier, xcurve = lr_sensitivity(make_cfg, tmp_path, "xavier")
    print(f"LR sensitivity: gpt2 init {gpt2:.3f} {curve}; xavier init {xavier:.3f} {xcurve}")
    assert gpt2 <= 0.5
