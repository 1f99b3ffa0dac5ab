"""The step measurement's deferred read: when the host reads each step's value, and what still happens at the step
itself; and the one stability callback that owns it."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from steadylm.stability import Stability, read_events
from steadylm.stability.measure import InFlight, Measurement, Packed, StepMeasure
from tests.helpers import FAST, Snapshot, faults, fit, stability_of

LOGGED_AND_SAVED = {3, 7, 11}  # FAST: log and checkpoint every 4 steps, i.e. at the end of steps 3, 7, 11


class Clock(L.Callback):
    """The optimizer step the Trainer is working on, for a patched `InFlight.read` to compare against."""

    step = -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        Clock.step = trainer.global_step


@pytest.fixture
def reads(monkeypatch):
    """(measured step, step under way) for every first host read of a measurement."""
    seen: list[tuple[int, int]] = []
    original = InFlight.read

    def read(self):
        if self._read is None:
            seen.append((self.step, Clock.step))
        return original(self)

    monkeypatch.setattr(InFlight, "read", read)
    return seen


@pytest.mark.parametrize(
    "override, deferred",
    [
        ("callbacks.stability.guard.max_consecutive=3", True),  # the default suite
        ("callbacks.stability.defer=false", False),
        ("callbacks.stability.spike.action=skip", False),  # a spike skip must be decided before the update
    ],
)
def test_the_host_reads_a_step_late_except_on_logging_and_checkpoint_steps(make_cfg, reads, override, deferred):
    objs = fit(make_cfg(*FAST, override), Clock())
    assert stability_of(objs["trainer"]).measure.deferred is deferred
    assert sorted(s for s, _ in reads) == list(range(12))  # every step measured and read exactly once
    same_step = {s for s, at in reads if s == at}
    if deferred:
        assert same_step == LOGGED_AND_SAVED  # there the host waits on purpose: logging and a consistent checkpoint
        assert all(at == s + 1 for s, at in reads if s not in same_step)
    else:
        assert same_step == set(range(12))


def test_a_nonfinite_last_step_is_reported_when_training_ends(make_cfg, tmp_path):
    # 11 steps: the last one (10) ends on no logging or checkpoint step, so only the end of training reads it.
    cfg = make_cfg(*FAST, "trainer.max_steps=11", faults({"kind": "inf_grad", "step": 10, "param": "wte.weight"}))
    objs = fit(cfg)
    events = read_events(tmp_path / "run")
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [(10, "nonfinite_grad", "skip")]
    assert events[0]["detail"]["module"] == "wte"  # named from the gradients kept on the device
    assert objs["module"].skipped_steps == 1
    opt = objs["trainer"].optimizers[0]
    assert not hasattr(opt, "found_inf")  # the device flag does not outlive the fit
    assert all(p.isfinite().all() for p in objs["module"].parameters())


def test_a_measurement_not_yet_acted_on_travels_in_the_checkpoint():
    m = Measurement(step=7, loss=2.5, grad_norm=float("inf"), loss_nonfinite=False, grad_nonfinite=True, batch_idx=(3,))
    measure = StepMeasure()
    measure.pending = m
    state = measure.state_dict()
    restored = StepMeasure()
    restored.load_state_dict(torch.load(_roundtrip(state), weights_only=True))
    assert restored.pending.read() == m
    assert StepMeasure().state_dict() == {"pending": None}


def _roundtrip(obj):
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf


def test_a_rollback_decided_a_step_late_also_drops_the_step_under_way(make_cfg, tmp_path, reads):
    # Steps 5 and 6 see NaN weights; step 6's value is read while step 7 runs (no checkpoint at the end of 6).
    cfg = make_cfg(
        *FAST,
        "callbacks.stability.guard.max_consecutive=2",
        faults({"kind": "nan_weight", "step": 5, "param": "blocks.1.mlp.fc.weight"}),
    )
    objs = fit(cfg, Clock())
    assert (6, 7) in reads
    events = read_events(tmp_path / "run")
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [
        (5, "nonfinite_loss", "skip"),
        (6, "nonfinite_loss", "rollback"),
        (6, "rollback", "rollback"),
    ]
    assert events[-1]["detail"]["to_step"] == 4 and events[-1]["detail"]["module"] == "blocks.1.mlp.fc"
    module = objs["module"]
    assert module.skipped_steps == 8 - 4  # steps 4..7 are not in the weights: 7 was under way, and dropped
    assert all(p.isfinite().all() for p in module.parameters())
    assert objs["trainer"].global_step == 12 and 7 not in {s for s, _ in reads}  # step 7 was never measured


def test_a_bad_step_not_yet_read_when_training_dies_is_counted_after_resume(make_cfg, tmp_path, monkeypatch):
    from steadylm.checkpointing import safe_load
    from steadylm.train import train
    from tests.helpers import crash_training_at

    args = [
        "trainer.max_steps=8",
        "callbacks.checkpoint.every_n_train_steps=4",
        faults({"kind": "inf_grad", "step": 5, "param": "wte.weight"}),
    ]
    crash_training_at(monkeypatch, 6)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(make_cfg(*args))
    monkeypatch.undo()
    saved = safe_load(tmp_path / "run" / "checkpoints" / "exception.ckpt")
    assert saved["steadylm"]["skipped_steps"] == 0  # step 5 was skipped on the device, not yet read on the host
    pending = saved["callbacks"]["steadylm.stability"]["measure"]["pending"]
    assert pending["step"] == 5 and pending["grad_nonfinite"]

    _, objects = train(make_cfg(*args, "resume=auto"))
    assert objects["trainer"].global_step == 8 and objects["module"].skipped_steps == 1
    assert [(e["step"], e["kind"]) for e in read_events(tmp_path / "run")] == [(5, "nonfinite_grad")]


def _reduced(*ranks: Packed) -> Packed:
    """What the step's collective does to the ranks' shares: sums added, maxima maxed (into the first)."""
    first = ranks[0]
    first.sums = torch.stack([r.sums for r in ranks]).sum(0)
    if first.maxes is not None:
        first.maxes = torch.stack([r.maxes for r in ranks]).amax(0)
    return first


def _read(packed: Packed, world: int) -> Measurement:
    return InFlight(3, packed, None, [], None, world, [], [0]).read()


def test_reduced_values_become_the_mean_loss_the_global_grad_norm_and_each_checks_values():
    t = torch.tensor
    # Replicated (DDP): both ranks hold the whole gradient, norm 5; their losses 2 and 4.
    ddp = _read(_reduced(Packed(t(2.0), t(5.0), {}, False), Packed(t(4.0), t(5.0), {}, False)), world=2)
    assert (ddp.loss, ddp.grad_norm, ddp.values) == (3.0, 5.0, {})
    # Sharded (FSDP): rank slices of norm 3 and 4; the global norm is 5, not their mean.
    fsdp = _read(_reduced(Packed(t(2.0), t(3.0), {}, True), Packed(t(4.0), t(4.0), {}, True)), world=2)
    assert (fsdp.loss, fsdp.grad_norm) == (3.0, 5.0)
    bad = _read(_reduced(Packed(t(2.0), t(3.0), {}, True), Packed(t(4.0), t(float("inf")), {}, True)), world=2)
    assert bad.grad_nonfinite and not bad.loss_nonfinite
    # A check's own values ride along: "mean" averages over ranks, "max" takes the largest, vectors stay vectors.
    ranks = [
        Packed(t(1.0), t(1.0), {"mine": {"a": ("mean", t(v)), "b": ("max", t([v, -v]))}}, False) for v in (2.0, 6.0)
    ]
    both = _read(_reduced(*ranks), world=2)
    assert both.values == {"mine": {"a": 4.0, "b": [6.0, -2.0]}}
    assert Measurement.from_state(both.state()) == both  # and they travel in a checkpoint


def test_accumulated_micro_batches_are_one_measurement_read_a_step_late(make_cfg, tmp_path, reads):
    snap = Snapshot(step=6)
    cfg = make_cfg(
        *FAST,
        "trainer.accumulate_grad_batches=2",
        faults({"kind": "inf_grad", "step": 6, "param": "blocks.0.attn.qkv.weight"}),
    )
    objs = fit(cfg, Clock(), snap)
    assert sorted(s for s, _ in reads) == list(range(12))  # one measurement per optimizer step, not per micro-batch
    assert {s for s, at in reads if s == at} == LOGGED_AND_SAVED
    events = read_events(tmp_path / "run")
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [(6, "nonfinite_grad", "skip")]
    assert len(events[0]["detail"]["batch"]) == 2  # both micro-batches' windows
    for name, p in snap.before["params"].items():
        assert torch.equal(p, snap.after["params"][name]), name
    assert objs["module"].skipped_steps == 1 and objs["trainer"].global_step == 12


def test_the_host_reads_the_step_before_each_checkpoint_is_written(make_cfg, reads):
    # Logging every 6 steps (5, 11), checkpoints every 4 (after steps 3, 7, 11): both make the host wait.
    fit(make_cfg(*FAST, "trainer.log_every_n_steps=6", "callbacks.stability.stats.every_n_steps=6"), Clock())
    assert {s for s, at in reads if s == at} == {3, 5, 7, 11}


def test_one_stability_callback_owns_every_check_tunable_and_removable_from_the_command_line(make_cfg):
    objs = fit(make_cfg(*FAST, "callbacks.stability.spike.sigma=5", "callbacks.stability.loss_scale=null"))
    owners = [cb for cb in objs["trainer"].callbacks if isinstance(cb, Stability)]
    assert len(owners) == 1
    owner = owners[0]
    assert owner.spike.sigma == 5.0 and owner.loss_scale is None
    assert owner.guard is not None and owner.stats is not None and owner.recovery.every_n_steps == 4
    assert owner.state_dict().get("loss_scale") is None  # a removed part keeps no state
    assert not [k for k in vars(objs["trainer"]) if "steadylm" in k or "stability" in k]  # nothing hung on it
