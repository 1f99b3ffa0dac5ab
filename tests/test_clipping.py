"""Clipping is on by default, and the suite's shortcut (reusing the probe's norm) changes no number."""

import torch

from steadylm.train import train


def final_weights(make_cfg, tmp_path, name: str, *overrides: str) -> dict[str, torch.Tensor]:
    _, objects = train(make_cfg("optim.lr=0.05", "trainer.max_steps=12", *overrides, out=tmp_path / name))
    return {k: v.detach().clone() for k, v in objects["module"].state_dict().items()}


def test_suite_clipping_equals_lightnings_own_bitwise(make_cfg, tmp_path):
    """At LR 0.05 every step is clipped; the suite must reproduce Lightning's clipping exactly."""
    suite = final_weights(make_cfg, tmp_path, "suite")
    plain = final_weights(make_cfg, tmp_path, "plain", "callbacks=minimal")
    unclipped = final_weights(make_cfg, tmp_path, "unclipped", "callbacks=minimal", "trainer.gradient_clip_val=null")
    assert all(torch.equal(suite[k], plain[k]) for k in suite)
    assert not all(torch.equal(suite[k], unclipped[k]) for k in suite)  # clipping was really active
