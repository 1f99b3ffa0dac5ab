"""Clipping is on by default, works under every precision with the suite on or off and fused or unfused AdamW,
and the pre-clip norm is logged in every case. Each test sets the precision it is about."""

import pytest
import torch

from steadylm.diagnose.runlog import load_run
from steadylm.train import train


def final_weights(make_cfg, tmp_path, name: str, *overrides: str) -> dict[str, torch.Tensor]:
    _, objects = train(
        make_cfg(
            "optim.lr=0.05", "trainer.max_steps=12", "trainer.log_every_n_steps=2", *overrides, out=tmp_path / name
        )
    )
    return {k: v.detach().clone() for k, v in objects["module"].state_dict().items()}


def test_suite_clipping_equals_lightnings_own_bitwise_in_fp32(make_cfg, tmp_path):
    """At LR 0.05 every step is clipped; reusing the probe's norm changes no bit of the result."""
    p = "trainer.precision=32-true"
    suite = final_weights(make_cfg, tmp_path, "suite", p)
    plain = final_weights(make_cfg, tmp_path, "plain", p, "callbacks=minimal")
    unclipped = final_weights(make_cfg, tmp_path, "unclipped", p, "callbacks=minimal", "trainer.gradient_clip_val=null")
    assert all(torch.equal(suite[k], plain[k]) for k in suite)
    assert not all(torch.equal(suite[k], unclipped[k]) for k in suite)  # clipping was really active


@pytest.mark.parametrize("callbacks", ["default", "minimal", "none", "default callbacks.stability.stats=null"])
@pytest.mark.parametrize("fused", ["true", "false"])
def test_bf16_clips_with_suite_on_or_off_and_logs_the_pre_clip_norm(make_cfg, tmp_path, callbacks, fused):
    """Lightning's mixed-precision plugin refuses clipping beside a fused optimizer; ours clips itself."""
    run = tmp_path / "run"
    preset, *dropped = callbacks.split()
    common = ("trainer.precision=bf16-mixed", f"callbacks={preset}", *dropped, f"optim.fused={fused}")
    clipped = final_weights(make_cfg, tmp_path, "run", *common)
    unclipped = final_weights(make_cfg, tmp_path, "unclipped", *common, "trainer.gradient_clip_val=null")
    assert all(torch.isfinite(v).all() for v in clipped.values())
    assert not all(torch.equal(clipped[k], unclipped[k]) for k in clipped)
    steps, norms = load_run(run).series("optim/grad_norm")
    assert len(steps) >= 5 and norms.max() > 1.0  # pre-clip: a clipped norm never exceeds the clip value 1.0
