"""The speedrun optimizer switches (issue 43): head/embedding LR multipliers, Muon's cautious weight decay and momentum
warmup. Each is off by default; each changes what it says on a real fit; a bad value is one line."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from steadylm.config import compose, validate_config
from steadylm.errors import ConfigError
from steadylm.muon import Muon, momentum_of, param_groups
from steadylm.schedule import set_lr
from steadylm.train import build, train
from tests.helpers import run_cli
from tests.test_muon import OPTIM, backward, tiny


def groups_of(opt, module) -> dict[str, dict]:
    """The group that holds each of the head, the token embedding and a block matrix."""
    net = module.net
    where = {"head": net.lm_head.weight, "embed": net.wte.weight, "block": net.blocks[0].attn.proj.weight}
    return {k: next(g for g in opt.param_groups if any(p is w for p in g["params"])) for k, w in where.items()}


@pytest.mark.parametrize("optim", ["adamw", "muon"])
def test_head_and_embedding_lrs_are_their_multiples_of_the_base_lr_after_a_fit(make_cfg, optim):
    mults = ["model.tie_embeddings=false", "optim.head_lr_mult=3.0", "optim.embed_lr_mult=0.5"]
    _, objs = train(make_cfg(f"optim={optim}", "trainer.max_steps=6", "optim.warmup_steps=2", *mults))
    opt, module = objs["trainer"].optimizers[0], objs["module"]
    g = groups_of(opt, module)
    base = opt.param_groups[0]["lr"]  # group 0 runs at optim/lr
    assert base > 0 and g["head"] is not g["embed"]
    assert g["head"]["lr"] == pytest.approx(3.0 * base) and g["embed"]["lr"] == pytest.approx(0.5 * base)
    assert g["block"]["lr"] == pytest.approx(base)  # (muon: lr_mult 1)
    assert g["head"]["weight_decay"] == g["embed"]["weight_decay"] == 0.1  # still decayed as matrices
    # each table moved alone: no other parameter runs at their LRs
    net = module.net
    assert [id(p) for p in g["head"]["params"]] == [id(net.lm_head.weight)]
    assert [id(p) for p in g["embed"]["params"]] == [id(net.wte.weight), id(net.wpe.weight)]


def test_at_one_the_groups_are_todays():
    net = tiny(tie_embeddings=False)
    ones = param_groups(net, {**OPTIM, "head_lr_mult": 1.0, "embed_lr_mult": 1.0})
    assert [[id(p) for p in g["params"]] for g in ones] == [
        [id(p) for p in g["params"]] for g in param_groups(net, OPTIM)
    ]
    assert len(ones) == 3  # decayed AdamW, plain AdamW, Muon


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


def muon_update(cautious: bool, weight_decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """A Muon matrix before and after one update with the same gradient."""
    net = tiny()
    opt = Muon(param_groups(net, {**OPTIM, "lr": 0.1, "weight_decay": weight_decay}), lr=0.1, cautious_wd=cautious)
    w = next(g for g in opt.param_groups if g["muon"])["params"][0]
    backward(net, 0)
    before = w.detach().clone()
    opt.step()
    return before, w.detach().clone()


def test_cautious_decay_leaves_coordinates_whose_update_opposes_their_sign():
    before, bare = muon_update(False, 0.0)
    step = before - bare  # p <- p - step
    _, plain = muon_update(False, 0.5)
    _, cautious = muon_update(True, 0.5)
    same = before * step > 0
    assert 0 < same.sum() < same.numel()
    decay = bare - cautious  # the decay alone: lr * wd * p where the signs agree, 0 elsewhere
    assert torch.equal(decay[~same], torch.zeros_like(decay[~same]))  # not decayed at all
    torch.testing.assert_close(decay[same], 0.1 * 0.5 * before[same])
    torch.testing.assert_close(bare - plain, 0.1 * 0.5 * before)  # plain decay: everywhere


def test_cautious_decay_and_warmup_keep_the_device_skip(make_cfg):
    """The inf_grad drill with both switches: step 25 skipped on the device, the weights finite and trained."""
    run = ["optim=muon", "experiment=divergence/inf_grad", "optim.muon.cautious_wd=true"]
    metrics, objs = train(make_cfg(*run, "optim.muon.momentum_warmup_steps=10"))
    assert objs["module"].skipped_steps == 1 and objs["trainer"].global_step == 30
    assert metrics["val/loss"] < 4.0  # from ln(257) = 5.55
    assert all(p.isfinite().all() for p in objs["module"].parameters())


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["optim.head_lr_mult=2.0"], "optim.head_lr_mult=2.0 is not allowed; it must be 1 with model.tie_embeddings"),
        (["optim.embed_lr_mult=0"], "optim.embed_lr_mult=0 is not allowed; it must be a number > 0"),
        (["optim=muon", "optim.muon.momentum_start=1.0"], "optim.muon.momentum_start=1.0 is not allowed"),
        (["optim=muon", "optim.muon.momentum_warmup_steps=-1"], "optim.muon.momentum_warmup_steps=-1 is not"),
        (["optim=muon", "optim.muon.cautious_wd=yes"], "optim.muon.cautious_wd='yes' is not allowed"),
    ],
)
def test_bad_values_are_one_config_error(overrides, line, tmp_path):
    with pytest.raises(ConfigError) as err:
        validate_config(
            compose([*overrides, "optim.warmup_steps=10", "model.vocab_size=320", f"paths.output_dir={tmp_path}"])
        )
    assert str(err.value).startswith(line) and "\n" not in str(err.value)


def test_an_untied_head_takes_any_positive_head_lr_mult(tmp_path):
    untied = ["model.tie_embeddings=false", "optim.head_lr_mult=2.0", "optim.warmup_steps=10"]
    validate_config(compose([*untied, "model.vocab_size=320", f"paths.output_dir={tmp_path}"]))


def test_cautious_decay_under_adamw_is_one_line(tmp_path):
    """Cautious decay is Muon's (torch's fused AdamW kernel has no mask): under optim=adamw the key does not exist."""
    out = run_cli("optim.muon.cautious_wd=true", "trainer.max_steps=1", cwd=tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "optim.muon is not a config key" in lines[0], (
        out.stderr
    )
