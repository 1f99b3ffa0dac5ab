"""A rewind is not a divergence: the `diverged` rule judges a run from the state the suite last restored, and a
run cut short after a reset says so instead."""

from __future__ import annotations

from steadylm.diagnose.findings import analyse
from steadylm.diagnose.report import write_report
from steadylm.diagnose.runlog import load_run
from steadylm.result import finish_job
from steadylm.stability import read_events
from steadylm.stability.instability import instability
from steadylm.stability.measure import Measurement
from steadylm.stability.recovery import Recovery
from steadylm.train import train


def _feed(recovery: Recovery, start: int, losses: list[float]) -> None:
    for i, loss in enumerate(losses):
        m = Measurement(step=start + i, loss=loss, grad_norm=1.0, loss_nonfinite=False, grad_nonfinite=False)
        recovery.confirm(m, suspect=False)


def test_the_best_loss_is_counted_from_the_last_restore():
    """Best 3.0 before a rewind to step 0; after it the loss sits at 7: not diverged (that best was thrown away
    on purpose), but unrecovered, with the reset's numbers; a real climb after the reset still diverges."""
    recovery = Recovery(final_window=5, final_margin=0.25)
    _feed(recovery, 0, [6.0, 5.0, 4.0, 3.0, 3.0, 3.0, 3.0, 3.0])
    assert recovery.best == 3.0
    recovery._judge_from(step=8, to_step=0)
    _feed(recovery, 8, [7.0] * 6)
    assert recovery.final_verdict() is None
    cut = recovery.unrecovered(step=14)
    assert cut == {"step": 8, "to_step": 0, "best_before": 3.0, "steps_after": 6, "final": 7.0, "lost_steps": 8}
    _feed(recovery, 14, [2.9] * 5)  # back below the pre-reset best: recovered
    assert recovery.unrecovered(step=19) is None
    _feed(recovery, 19, [5.0] * 5)  # then 72 % above the best since the reset: a real divergence
    assert recovery.final_verdict().kind == "final_loss"
    state = recovery.state_dict()
    again = Recovery(final_window=5)
    again.load_state_dict(state)
    assert again.restored == recovery.restored and again.best == recovery.best


def test_a_second_reset_keeps_the_best_of_all_the_abandoned_states():
    recovery = Recovery(final_window=2)
    _feed(recovery, 0, [3.0, 3.0])
    recovery._judge_from(step=2, to_step=0)
    _feed(recovery, 2, [6.0])  # too few steps for a best of its own
    recovery._judge_from(step=3, to_step=0)
    assert recovery.restored["best_before"] == 3.0


def test_a_run_rewound_near_its_end_is_unstable_not_diverged(make_cfg, tmp_path):
    """lr 0.1 without QK-norm: QK-clip rewinds to step 0 with the LR x0.1 and a re-warmup; the run ends before its
    loss came back. With the best counted over the whole run this ended `diverged` (exit 3)."""
    cfg = make_cfg(
        "model.qk_norm=false",
        "optim.lr=0.1",
        "optim.warmup_steps=20",
        "trainer.max_steps=24",
        "callbacks.stability.qk_clip.backoff_after=2",
        "callbacks.stability.recovery.every_n_steps=5",
        "callbacks.stability.recovery.final_window=5",
        "callbacks.checkpoint.every_n_train_steps=24",
    )
    metrics, _ = train(cfg)
    run = tmp_path / "run"
    events = read_events(run)
    rewinds = [e for e in events if e["kind"] == "rollback"]
    assert rewinds and rewinds[-1]["detail"]["to_step"] == 0, [(e["step"], e["kind"]) for e in events]
    assert not any(e["action"] == "stop" for e in events)
    cut = [e["detail"] for e in events if e["kind"] == "unrecovered"]
    assert cut and cut[0]["to_step"] == 0 and cut[0]["lost_steps"] == rewinds[-1]["detail"]["skipped_data_steps"]
    _, status, reason = finish_job(cfg, metrics)
    assert status == "unstable", reason
    assert f"reset the run at step {cut[0]['step']} to step 0" in reason and "cut short, not diverged" in reason
    assert reason == instability(run, 0.1)
    log = load_run(run)
    assert log.loss_onset() is None  # the climb back to the step-0 loss is the reset, not the loss diverging
    report = write_report(log, analyse(log)).read_text()
    assert "the loss diverged" not in report
    assert f"at step {rewinds[-1]['step']} back to step 0" in report and "cut short, not diverged" in report
