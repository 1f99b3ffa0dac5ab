"""doctor's LR-stability probe: real short training runs flag an unstable configured LR, name the largest
stable LR and the stabiliser that widens the region, and pass the default LR; a big model is probed on a proxy."""

from __future__ import annotations

import pytest
import torch

from steadylm.config import compose
from steadylm.doctor.check import FAIL
from steadylm.doctor.lr_probe import EXCESS, Probe, check_lr_probe, probe_vocab, proxy_model
from steadylm.resolve import fill_derived


def test_a_big_model_is_probed_on_a_proxy_with_its_head_size_and_grouping():
    llama = dict(compose(["model=llama_1b"]).model)
    proxy, where = proxy_model(llama, max_layers=4, max_width=256, max_context=256)
    assert (proxy["n_layer"], proxy["d_model"], proxy["context_length"]) == (4, 256, 256)
    assert proxy["d_model"] // proxy["n_head"] == llama["d_model"] // llama["n_head"]  # head size kept: 64
    assert proxy["n_head"] // proxy["n_kv_head"] == 4  # 32 query / 8 key-value heads: groups of 4 kept
    assert proxy["mlp_hidden"] == 8192 * 256 // 2048
    assert where.startswith("proxy (n_layer=4, n_head=4, n_kv_head=1, d_model=256")
    narrow, where = proxy_model(llama, max_layers=4, max_width=128, max_context=128)
    assert (narrow["d_model"], narrow["n_head"], narrow["n_kv_head"]) == (128, 2, 1)  # no room for a group of 4
    tiny = dict(compose(["model=tiny"]).model)
    assert proxy_model(tiny, 4, 256, 256) == ({**tiny, "n_kv_head": 4}, "the model itself")


def test_an_sp_proxy_is_mup_based_at_the_full_width_and_a_mup_proxy_keeps_its_base():
    small_sp = dict(compose(["model=small"]).model)  # sp: the default
    proxy, where = proxy_model(small_sp, max_layers=4, max_width=128, max_context=128)
    assert (proxy["d_model"], proxy["n_head"], proxy["parametrization"]) == (128, 2, "mup")
    assert (proxy["mup_base_width"], proxy["mup_base_head_dim"]) == (768, 64)  # mup at its base is this sp model
    assert "parametrization=mup" in where
    small = dict(compose(["model=small", "model.parametrization=mup"]).model)
    proxy, where = proxy_model(small, max_layers=4, max_width=128, max_context=128)
    assert (proxy["d_model"], proxy["mup_base_width"], proxy["mup_base_head_dim"]) == (128, 128, 32)
    assert "parametrization" not in where
    x = torch.tensor([[0, 5, 200]])
    assert probe_vocab(proxy, [(x, x)]) == ({**proxy, "vocab_size": 256}, "vocab_size=256")


def curve(lr: float, start: float, end: float, steps: int = 40) -> Probe:
    losses = [start + (end - start) * min(1.0, i / (steps // 2)) for i in range(steps)]
    return Probe(lr, losses, [5.0] * steps, [5.0] * steps, [0.01] * steps)


def test_an_lr_is_judged_by_its_loss_against_the_start_and_the_best_lower_lr_not_its_first_steps():
    assert "ended above its start (5.60 -> 9.00" in curve(0.3, 5.6, 9.0).unstable(100.0)
    lower = curve(0.01, 5.6, 2.6)
    close = 2.6 + 0.9 * EXCESS * 3.0
    assert curve(0.03, 5.6, close).unstable(100.0, lower) is None
    far = curve(0.1, 5.6, 2.6 + 1.1 * EXCESS * 3.0).unstable(100.0, lower)
    assert far.startswith("loss ended") and "above lr 0.01's" in far
    climbed = curve(0.1, 5.6, 2.0)
    climbed.losses[-10:] = [4.5] * 10
    assert "gave back more than half" in climbed.unstable(100.0)


@pytest.mark.slow
@pytest.mark.parametrize("lr", [2e-3, 0.03, 0.1])
def test_probe_fails_the_unstable_lrs_of_the_tiny_model_and_passes_the_default(lr, shards_dir):
    cfg = compose(
        ["model=tiny", "model.qk_norm=false", f"optim.lr={lr}", "trainer=cpu", f"data.dir={shards_dir}"],
        config_name="doctor",
    )
    fill_derived(cfg)  # as doctor does: the vocabulary from the shards, the warmup from the run length
    (row,) = check_lr_probe(cfg)
    if lr == 2e-3:  # the default
        assert row.status != FAIL, row
        # x1 is optim.lr carried to the probe's smaller batch by the rule's tokens term (0.002 -> 0.00187)
        assert "x1 lr 0.00187: loss" in row.evidence and "UNSTABLE" not in row.evidence.split("x1 lr")[1].split(";")[0]
        return
    assert row.status == FAIL, row
    assert f"optim.lr={lr:g} is in the unstable region" in row.evidence
    x1 = row.evidence.split("x1 lr")[1].split("; x")[0]
    # the cause (the logits past tau, or the suite's own signal, whichever came first), and the cost
    assert "UNSTABLE: max attention logit" in x1 or "the suite's level" in x1 or "the stability suite forecasts" in x1
    assert " s: " in row.evidence
    largest = float(row.fix.split("optim.lr<=")[1].split(" ")[0])
    assert largest < lr


@pytest.mark.slow
@pytest.mark.parametrize("lr", [0.1, 0.3])
def test_with_qk_norm_the_probe_fails_an_lr_whose_loss_shows_it_though_the_logits_stay_bounded(lr, shards_dir):
    cfg = compose(
        ["model=tiny", "model.qk_norm=true", f"optim.lr={lr}", "trainer=cpu", f"data.dir={shards_dir}"],
        config_name="doctor",
    )
    fill_derived(cfg)  # as doctor does: the vocabulary from the shards, the warmup from the run length
    (row,) = check_lr_probe(cfg)
    assert row.status == FAIL, row
    x1 = row.evidence.split("x1 lr")[1].split("; x")[0]
    why = x1.split("UNSTABLE: ")[1]
    # the logits stay bounded: the loss shows it, or the suite's residual-stream signal
    assert why.startswith(("loss ended", "residual_rms", "the stability suite forecasts residual_rms")), x1
