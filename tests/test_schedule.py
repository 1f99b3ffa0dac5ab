"""The LR schedule: its three shapes, its refusals, and a wsd anneal from a stable-phase checkpoint, bitwise."""

from __future__ import annotations

import math

import pytest
import torch

from steadylm.checkpointing import safe_load
from steadylm.config import compose, validate_config
from steadylm.errors import ConfigError
from steadylm.resume import check_resume
from steadylm.schedule import Schedule
from steadylm.train import train
from tests.test_resume import same, step_losses


def test_cosine_warms_up_then_decays_smoothly():
    s = Schedule(lr=1e-3, min_lr=1e-4, warmup_steps=10, total_steps=110)
    assert s(0) == pytest.approx(1e-4) and s(9) == pytest.approx(1e-3)
    assert s(60) == pytest.approx(5.5e-4) and s(110) == pytest.approx(1e-4)
    curve = [s(t) for t in range(10, 111)]
    assert all(a >= b for a, b in zip(curve, curve[1:]))  # no abrupt jump up or down after warmup
    assert max(abs(a - b) for a, b in zip(curve, curve[1:])) < 2e-5


def test_linear_decays_in_a_straight_line():
    s = Schedule(lr=1e-3, min_lr=1e-4, warmup_steps=10, total_steps=110, shape="linear")
    assert s(10) == 1e-3 and s(60) == pytest.approx(5.5e-4) and s(85) == pytest.approx(3.25e-4)
    assert s(110) == 1e-4


def test_wsd_is_flat_then_decays_as_one_minus_sqrt_over_its_fraction():
    s = Schedule(lr=1e-3, min_lr=1e-4, warmup_steps=10, total_steps=100, shape="wsd", decay_fraction=0.2)
    assert s.decay_start == 80
    assert s(9) == 1e-3 and all(s(t) == 1e-3 for t in range(10, 81))  # exactly flat: the same float every step
    assert s(85) == pytest.approx(1e-4 + 9e-4 * (1 - math.sqrt(0.25)))
    assert s(99) > s(100) == 1e-4
    longer = Schedule(lr=1e-3, min_lr=1e-4, warmup_steps=10, total_steps=1000, shape="wsd", decay_fraction=0.2)
    assert [longer(t) for t in range(80)] == [s(t) for t in range(80)]  # any length: the same flat part


def test_lr_is_the_schedule_times_the_rewarm_times_the_scale():
    s = Schedule(lr=1e-3, min_lr=1e-4, warmup_steps=2, total_steps=20, shape="wsd")
    assert s.lr_of(10) == s(10)
    assert s.lr_of(10, scale=0.1, rewarm=(9, 4)) == s(10) * (2 / 4) * 0.1  # 2nd step of a 4-step re-warmup


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["optim.schedule=step"], "optim.schedule='step' is not allowed; use one of: cosine, wsd, linear"),
        (["optim.schedule=wsd", "optim.decay_fraction=0"], "optim.decay_fraction=0.0 is not allowed"),
        (
            ["optim.schedule=wsd", "optim.decay_fraction=0.9", "trainer.max_steps=200"],
            "starts wsd's decay at step 20 of 200, inside the 100-step warmup",
        ),
    ],
)
def test_a_schedule_that_cannot_run_is_refused_in_one_line(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        validate_config(
            compose([*overrides, "model.vocab_size=320", "optim.warmup_steps=100", f"paths.output_dir={tmp_path}"])
        )
    assert message in str(err.value) and "\n" not in str(err.value)


WSD = dict(lr=1e-3, min_lr=1e-4, warmup_steps=5, shape="wsd", decay_fraction=0.25)


def optim_of(s: Schedule) -> dict:
    return dict(
        lr=s.lr, min_lr=s.min_lr, warmup_steps=s.warmup_steps, total_steps=s.total_steps, schedule=s.shape,
        decay_fraction=s.decay_fraction,
    )  # fmt: skip


def test_an_anneal_from_the_stable_phase_is_allowed_and_from_the_decay_refused():
    long = Schedule(total_steps=400, **WSD)  # decay from step 300
    short = Schedule(total_steps=40, **WSD)  # decay from step 30
    check_resume(optim_of(long), short, 30, "ckpt_path=x")  # steps 0..29: flat in both
    check_resume(optim_of(long), Schedule(total_steps=4000, **WSD), 300, "ckpt_path=x")  # an extension, too
    check_resume(optim_of(long), long, 350, "ckpt_path=x")  # a plain resume
    with pytest.raises(ConfigError) as err:
        check_resume(optim_of(long), short, 35, "ckpt_path=x")
    assert str(err.value) == (
        "ckpt_path=x has 35 applied steps under wsd: warmup 5, flat 0.001 to step 300, 1-sqrt decay to 0.0001 at "
        "step 400; this run's wsd: warmup 5, flat 0.001 to step 30, 1-sqrt decay to 0.0001 at step 40 would have "
        "given step 31 LR 0.0007154, not 0.001; anneal from a checkpoint saved at or before step 31, or keep "
        "optim.total_steps=400"
    )


@pytest.mark.parametrize(
    "change,fix",
    [
        ({"total_steps": 80}, "keep optim.total_steps=40 (the LR then stays at optim.min_lr past it); only "),
        ({"lr": 2e-3}, "resume with the checkpoint's optim.schedule=cosine optim.lr=0.001 optim.warmup_steps=5"),
        ({"shape": "wsd"}, "resume with the checkpoint's optim.schedule=cosine"),
    ],
)
def test_a_resume_that_would_rewrite_the_lr_of_steps_taken_is_refused(change, fix):
    saved = Schedule(lr=1e-3, min_lr=1e-4, warmup_steps=5, total_steps=40)
    kw = {**dict(lr=1e-3, min_lr=1e-4, warmup_steps=5, total_steps=40), **change}
    if "total_steps" in change:  # the warmup does not depend on the length
        check_resume(optim_of(saved), Schedule(**kw), 5, "c")
    with pytest.raises(ConfigError, match="has 20 applied steps") as err:
        check_resume(optim_of(saved), Schedule(**kw), 20, "c")
    assert fix in str(err.value)


# wsd over 24 steps decays from step 18; over 48, from step 36: a checkpoint at step 12 is flat in both.
ANNEAL = [
    "optim.schedule=wsd",
    "optim.decay_fraction=0.25",
    "optim.warmup_steps=3",
    "model.dropout=0.1",  # the loss depends on the RNG stream: a resume that lost it shows
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=6",
    "data.val_windows=16",
    "callbacks.checkpoint.every_n_train_steps=12",
]


def test_an_anneal_from_a_stable_checkpoint_equals_the_short_run_bitwise(make_cfg, tmp_path):
    """One long wsd run, a 24-step budget from its step-12 checkpoint: the same weights, optimizer state and
    losses as a 24-step wsd run trained straight through."""
    straight, long, anneal = tmp_path / "straight", tmp_path / "long", tmp_path / "anneal"
    train(make_cfg(*ANNEAL, "trainer.max_steps=24", out=straight))
    train(make_cfg(*ANNEAL, "trainer.max_steps=12", "optim.total_steps=48", out=long))  # a 48-step run's start
    stable = long / "checkpoints" / "step0000012.ckpt"
    assert safe_load(stable)["steadylm"]["config"]["optim"]["total_steps"] == 48
    _, objects = train(make_cfg(*ANNEAL, "trainer.max_steps=24", f"ckpt_path={stable}", out=anneal))
    assert objects["trainer"].global_step == 24 and objects["module"].schedule.decay_start == 18
    a, b = safe_load(straight / "checkpoints" / "last.ckpt"), safe_load(anneal / "checkpoints" / "last.ckpt")
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])
    assert same(a["optimizer_states"], b["optimizer_states"])
    expected, got = step_losses(straight), step_losses(anneal)
    assert got == {s: v for s, v in expected.items() if s >= 12} and len(got) == 12  # every step after the checkpoint


def test_an_anneal_from_inside_the_decay_is_refused_before_anything_runs(make_cfg, tmp_path):
    train(make_cfg(*ANNEAL, "trainer.max_steps=12", "optim.total_steps=14", out=tmp_path / "long"))
    decaying = tmp_path / "long" / "checkpoints" / "step0000012.ckpt"  # wsd over 14 decays from step 10
    with pytest.raises(ConfigError, match="has 12 applied steps under wsd") as err:
        train(make_cfg(*ANNEAL, "trainer.max_steps=24", f"ckpt_path={decaying}", out=tmp_path / "anneal"))
    assert "anneal from a checkpoint saved at or before step 11" in str(err.value)
    assert not (tmp_path / "anneal" / "checkpoints").exists()


def test_doctor_plots_and_describes_the_wsd_phases(make_cfg, tmp_path):
    from steadylm.doctor.check import OK
    from steadylm.doctor.config_checks import check_schedule

    png = tmp_path / "lr.png"
    row = check_schedule(make_cfg("optim.schedule=wsd", "optim.decay_fraction=0.2"), png)[0]
    assert row.status == OK and row.evidence.startswith(
        "wsd: warmup 5, flat 0.002 to step 24, 1-sqrt decay to 0.0002 at step 30; peak 0.002 at step 4"
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 5000
