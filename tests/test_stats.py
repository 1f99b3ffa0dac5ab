"""`GradParamStats` logs the numbers it claims: checked against a brute-force computation on the same step."""

from __future__ import annotations

import pytest

from tests.helpers import FAST, Truth, fit, norm, scalars


def test_logged_stats_equal_a_brute_force_computation(make_cfg, tmp_path):
    truth = Truth()
    fit(make_cfg(*FAST, "optim.lr=1e-2"), truth)
    tags = scalars(tmp_path / "run")
    n_blocks = 2
    at = lambda tag: tags[tag][1]  # noqa: E731  (the second stats step)
    names = list(truth.before)
    delta = {n: truth.after[n] - truth.before[n] for n in names}
    for i in range(n_blocks):
        own = [n for n in names if n.startswith(f"blocks.{i}.")]
        assert at(f"stability/grad_norm/block_{i}") == pytest.approx(norm(truth.grads[n] for n in own), rel=1e-5)
        assert at(f"stability/param_norm/block_{i}") == pytest.approx(norm(truth.before[n] for n in own), rel=1e-5)
        ratio = norm(delta[n] for n in own) / norm(truth.before[n] for n in own)
        assert at(f"stability/update_ratio/block_{i}") == pytest.approx(ratio, rel=1e-4)
        assert at(f"stability/act_rms/block_{i}") == pytest.approx(truth.rms[i], rel=1e-5)
    total = norm(delta.values()) / norm(truth.before.values())
    assert at("stability/update_ratio") == pytest.approx(total, rel=1e-4) and total > 0
    # log Z from the default (chunked) loss, which never calls the output head as a module
    assert at("stability/log_z") == pytest.approx(truth.log_z, rel=1e-5)
    assert at("optim/grad_norm") == pytest.approx(norm(truth.grads.values()), rel=1e-5)
