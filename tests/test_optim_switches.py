"""Muon's momentum warmup (modded-nanogpt's speedrun switch): off by default; the momentum follows the applied steps
on a real fit, through a skipped step; a bad value is one line."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from steadylm.config import compose, validate_config
from steadylm.errors import ConfigError
from steadylm.muon import Muon, momentum_of, param_groups
from steadylm.schedule import set_lr
from steadylm.train import build, train
from tests.test_muon import OPTIM, backward, tiny


def test_the_first_update_uses_momentum_start_and_step_n_the_momentum():
    net = tiny()
    opt = Muon(param_groups(net, OPTIM), lr=1e-3, momentum=0.95, momentum_start=0.5, momentum_warmup_steps=4)
    muon = next(g for g in opt.param_groups if g["muon"])
    w = muon["params"][0]
    backward(net, 0)
    set_lr(opt, 1e-3, 0)
    opt.step()
    assert torch.equal(opt.state[w]["momentum_buffer"], torch.zeros_like(w).lerp(w.grad, 1 - 0.5))
    seen = []
    for step in range(1, 6):
        set_lr(opt, 1e-3, step)
        seen.append(momentum_of(muon))
    assert seen == pytest.approx([0.6125, 0.725, 0.8375, 0.95, 0.95])


class Momenta(L.Callback):
    """(global step, the applied step the Muon groups were at, their momentum) of every update."""

    def __init__(self):
        self.seen = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        group = next(g for g in trainer.optimizers[0].param_groups if g["muon"])
        self.seen.append((trainer.global_step - 1, group["applied_step"], momentum_of(group)))


def test_momentum_warmup_counts_applied_steps_through_a_skipped_one(make_cfg):
    run = ["optim=muon", "experiment=divergence/inf_grad", "optim.muon.momentum_warmup_steps=28"]
    objs = build(make_cfg(*run, "optim.muon.momentum_start=0.65"))
    momenta = Momenta()
    objs["trainer"].callbacks.append(momenta)
    objs["trainer"].fit(objs["module"], datamodule=objs["datamodule"])
    assert objs["module"].skipped_steps == 1  # step 25, skipped on the device
    applied = [a for _, a, _ in momenta.seen]
    # deferred: step 25's skip is counted at step 26, which runs at 25 again, exactly as the LR does
    assert applied == [*range(26), *range(25, 29)]
    assert momenta.seen[0][2] == pytest.approx(0.65) and momenta.seen[-1][2] == pytest.approx(0.95)
    assert momenta.seen[25][2] == momenta.seen[26][2] == pytest.approx(0.65 + 0.3 * 25 / 28)
    assert all(p.isfinite().all() for p in objs["module"].parameters())


def test_momentum_warmup_keeps_the_device_skip(make_cfg):
    """The inf_grad drill with the warmup: step 25 skipped on the device, the weights finite and trained."""
    run = ["optim=muon", "experiment=divergence/inf_grad"]
    metrics, objs = train(make_cfg(*run, "optim.muon.momentum_warmup_steps=10"))
    assert objs["module"].skipped_steps == 1 and objs["trainer"].global_step == 30
    assert metrics["val/loss"] < 4.0  # from ln(257) = 5.55
    assert all(p.isfinite().all() for p in objs["module"].parameters())


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["optim=muon", "optim.muon.momentum_start=1.0"], "optim.muon.momentum_start=1.0 is not allowed"),
        (["optim=muon", "optim.muon.momentum_warmup_steps=-1"], "optim.muon.momentum_warmup_steps=-1 is not"),
    ],
)
def test_bad_values_are_one_config_error(overrides, line, tmp_path):
    with pytest.raises(ConfigError) as err:
        validate_config(
            compose([*overrides, "optim.warmup_steps=10", "model.vocab_size=320", f"paths.output_dir={tmp_path}"])
        )
    assert str(err.value).startswith(line) and "\n" not in str(err.value)
