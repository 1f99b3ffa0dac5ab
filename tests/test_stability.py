"""The stability suite on the real Trainer: inject each fault, assert detection, the named cause, intact state."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch

from steadylm.stability import read_events
from steadylm.stability.spike import RollingStats, SpikeDetector
from steadylm.train import build

FAST = [
    "trainer.max_steps=12", "trainer.limit_val_batches=0", "callbacks.checkpoint.every_n_train_steps=4",
    "trainer.log_every_n_steps=4", "model.d_model=32", "model.context_length=32", "data.batch_size=4",
]


def faults(*specs: dict) -> str:
    items = ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in s.items()) + "}" for s in specs)
    return f"+callbacks.faults={{_target_: steadylm.stability.FaultInjector, faults: [{items}]}}"


class Snapshot(L.Callback):
    """Copies weights and AdamW state just before and just after optimizer step `step`."""

    def __init__(self, step: int):
        self.step, self.before, self.after, self.lrs = step, None, None, []

    @staticmethod
    def _state(trainer, pl_module):
        opt = trainer.optimizers[0]
        return {
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "adam": {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(pl_module.parameters())},
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])
        if trainer.global_step == self.step:
            self.before = self._state(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step + 1:
            self.after = self._state(trainer, pl_module)


def fit(cfg, *extra_callbacks):
    objs = build(cfg)
    objs["trainer"].callbacks.extend(extra_callbacks)
    objs["trainer"].fit(objs["module"], datamodule=objs["datamodule"])
    return objs


def test_inf_grad_skips_exactly_that_step_and_leaves_weights_and_adam_bitwise_untouched(make_cfg, tmp_path):
    snap = Snapshot(step=6)
    cfg = make_cfg(*FAST, faults({"kind": "inf_grad", "step": 6, "param": "blocks.0.attn.qkv.weight"}))
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
    assert snap.lrs[7] == snap.lrs[6]  # the schedule did not advance on the skipped step

    clean = fit(make_cfg(*FAST, out=tmp_path / "clean"))
    final = objs["trainer"].callback_metrics["train/loss"].item()
    assert final == pytest.approx(clean["trainer"].callback_metrics["train/loss"].item(), rel=0.05)


def test_nan_weight_is_named_skipped_then_rolled_back_to_last_good_checkpoint(make_cfg, tmp_path):
    cfg = make_cfg(*FAST, "callbacks.guard.max_consecutive=2",
                   faults({"kind": "nan_weight", "step": 6, "param": "blocks.1.mlp.fc.weight"}))
    objs = fit(cfg)
    events = read_events(tmp_path / "run")
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [
        (6, "nonfinite_loss", "skip"), (7, "nonfinite_loss", "rollback"), (7, "rollback", "rollback"),
    ]
    assert all(e["detail"]["module"] == "blocks.1.mlp.fc" for e in events)
    assert events[-1]["detail"]["to_step"] == 4
    module = objs["module"]
    assert all(p.isfinite().all() for p in module.parameters())
    assert module.skipped_steps == 8 - 4  # steps 4..7 are not in the weights
    assert math.isfinite(objs["trainer"].callback_metrics["train/loss"].item())


def test_nan_weight_with_stop_halts_every_rank_and_writes_forensics(make_cfg, tmp_path):
    cfg = make_cfg(*FAST, "callbacks.guard.max_consecutive=2", "callbacks.guard.action=stop",
                   faults({"kind": "nan_weight", "step": 5, "param": "blocks.1.mlp.fc.weight"}))
    objs = fit(cfg)
    assert objs["trainer"].global_step == 7  # stopped right after the second skip
    events = read_events(tmp_path / "run")
    assert [(e["step"], e["kind"]) for e in events] == [(5, "nonfinite_loss"), (6, "nonfinite_loss"), (6, "stop")]
    assert events[-1]["detail"]["module"] == "blocks.1.mlp.fc"
    bundle = json.loads((tmp_path / "run" / "stability" / "forensics" / "step_6.json").read_text())
    assert bundle["forward"] == "blocks.1.mlp.fc" and bundle["streak_start"] == 5
    assert bundle["layers"]["blocks.1.mlp.fc"]["param_nonfinite"] is True
    assert bundle["layers"]["blocks.0.mlp.fc"]["out_nonfinite"] == 0
    assert len(bundle["batch"][0]) == 4


def test_random_labels_fire_the_loss_spike_detector_at_that_step(make_cfg, tmp_path):
    cfg = make_cfg(*FAST, "trainer.max_steps=30", "optim.lr=1e-2", "callbacks.spike.window=12",
                   "callbacks.spike.warmup=8", faults({"kind": "corrupt_labels", "step": 26}))
    fit(cfg)
    spikes = [(e["step"], e["detail"]["value"]) for e in read_events(tmp_path / "run") if e["kind"] == "loss_spike"]
    assert [s for s, _ in spikes] == [26] and spikes[0][1] > 5.0  # ~ln(vocab) on random labels


def test_lr_times_1000_for_one_step_raises_the_update_ratio_alarm(make_cfg, tmp_path):
    cfg = make_cfg(*FAST, faults({"kind": "lr_spike", "step": 7, "factor": 1000}))
    fit(cfg)
    events = read_events(tmp_path / "run")
    ratio = [e for e in events if e["kind"] == "update_ratio"]
    assert [e["step"] for e in ratio] == [7]  # step 7 is a stats step: (7 + 1) % 4 == 0
    assert ratio[0]["detail"]["value"] > 1.0


def test_spike_detector_state_survives_a_round_trip():
    det = SpikeDetector(window=4, warmup=2)
    for v in (1.0, 2.0, 3.0, 4.0, 5.0):
        det.stats["loss"].add(v)
    state = json.loads(json.dumps(det.state_dict()))  # plain types: safe for weights_only checkpoints
    other = SpikeDetector(window=4, warmup=2)
    other.load_state_dict(state)
    assert list(other.stats["loss"].values) == [2.0, 3.0, 4.0, 5.0]
    assert other.stats["loss"].threshold(6.0) == pytest.approx(RollingStats(4, [2, 3, 4, 5]).threshold(6.0))
    assert RollingStats(4, [2, 3, 4, 5]).threshold(1.0) == pytest.approx(3.5 + math.sqrt(1.25))
