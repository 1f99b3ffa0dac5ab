"""`GradParamStats` logs the numbers it claims: checked against a brute-force computation on the same step."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from tests.test_stability import FAST, fit
from tests.test_train import scalars

STEP = 7  # a stats step under FAST: (7 + 1) % 4 == 0, the second of steps 3, 7, 11


def norm(tensors) -> float:
    return float(torch.sqrt(sum(t.double().pow(2).sum() for t in tensors)))


class Truth(L.Callback):
    """Weights, pre-clip grads and the batch of step STEP, and the weights after its update."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == STEP:
            self.batch = [t.clone() for t in batch]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # after backward, before clipping
        if trainer.global_step == STEP:
            net = pl_module.net
            self.before = {n: p.detach().clone() for n, p in net.named_parameters()}
            self.grads = {n: p.grad.detach().clone() for n, p in net.named_parameters()}
            rms = {}
            hooks = [
                b.register_forward_hook(lambda m, a, out, i=i: rms.__setitem__(i, float(out.pow(2).mean().sqrt())))
                for i, b in enumerate(net.blocks)
            ]
            with torch.no_grad():
                net(self.batch[0])
            for h in hooks:
                h.remove()
            self.rms = rms

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == STEP + 1:
            self.after = {n: p.detach().clone() for n, p in pl_module.net.named_parameters()}


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
    assert at("optim/grad_norm") == pytest.approx(norm(truth.grads.values()), rel=1e-5)
