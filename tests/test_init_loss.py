"""A run that starts from a wrong init (its first loss far from ln(vocab_size)) is flagged by the default suite
at step 0, with the evidence, and its job ends `unstable` with the fix; a proper init raises nothing."""

from __future__ import annotations

import json
import math

from steadylm.result import finish_job
from steadylm.stability import read_events
from steadylm.train import train


def test_a_wrong_init_is_flagged_at_step_0_and_the_run_ends_unstable(make_cfg, tmp_path):
    cfg = make_cfg(
        "model.init=torch_default",
        "trainer.max_steps=3",
        "optim.warmup_steps=1",
        "callbacks.checkpoint.every_n_train_steps=3",
    )
    train(cfg)
    (event,) = [e for e in read_events(tmp_path / "run") if e["kind"] == "init_loss"]
    detail = event["detail"]
    assert event["step"] == 0 and event["action"] == "log" and detail["init"] == "torch_default"
    assert detail["expected"] == math.log(cfg.model.vocab_size) and detail["loss"] > detail["expected"] + 1.0
    finish_job(cfg, {"train/loss": 5.0, "val/loss": 5.0})
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["status"] == "unstable"
    assert result["reason"].startswith(f"the initial loss was {detail['loss']:.3g} nats")
    assert "fix: use model.init=gpt2" in result["reason"]

    train(
        make_cfg(
            "trainer.max_steps=3",
            "optim.warmup_steps=1",
            "callbacks.checkpoint.every_n_train_steps=3",
            out=tmp_path / "gpt2",
        )
    )
    assert not [e for e in read_events(tmp_path / "gpt2") if e["kind"] == "init_loss"]


def test_a_run_from_trained_weights_has_no_init_to_judge(make_cfg, tmp_path):
    """`init_from` loads weights whose loss is rightly far from ln(vocab_size): no `init_loss` event. The weights here
    are a wrong init's, so the only thing that keeps the event away is that they were loaded."""
    steps = ["trainer.max_steps=2", "optim.warmup_steps=1", "callbacks.checkpoint.every_n_train_steps=2"]
    train(make_cfg("model.init=torch_default", *steps, out=tmp_path / "a"))
    assert [e["kind"] for e in read_events(tmp_path / "a") if e["kind"] == "init_loss"] == ["init_loss"]
    ckpt = tmp_path / "a" / "checkpoints" / "last.ckpt"
    train(make_cfg("model.init=torch_default", *steps, f"init_from={ckpt}", out=tmp_path / "b"))
    assert not [e for e in read_events(tmp_path / "b") if e["kind"] == "init_loss"]
