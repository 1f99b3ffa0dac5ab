"""doctor's LR-stability probe: real short training runs flag an unstable configured LR, name the largest
stable LR and the stabiliser that widens the region, and pass the default LR; a big model is probed on a proxy."""

from __future__ import annotations

import pytest

from steadylm.config import compose
from steadylm.doctor.check import FAIL
from steadylm.doctor.lr_probe import check_lr_probe, proxy_model


def test_a_big_model_is_probed_on_a_proxy_with_its_head_size_and_grouping():
    llama = dict(compose(["model=llama_1b"]).model)
    proxy, where = proxy_model(llama, max_layers=4, max_width=256, max_context=256)
    assert (proxy["n_layer"], proxy["d_model"], proxy["context_length"]) == (4, 256, 256)
    assert proxy["d_model"] // proxy["n_head"] == llama["d_model"] // llama["n_head"]  # head size kept: 64
    assert proxy["n_head"] // proxy["n_kv_head"] == 4  # 32 query / 8 key-value heads: groups of 4 kept
    assert proxy["mlp_hidden"] == 8192 * 256 // 2048
    assert where.startswith("proxy (n_layer=4, n_head=4, n_kv_head=1, d_model=256")
    tiny = dict(compose(["model=tiny"]).model)
    assert proxy_model(tiny, 4, 256, 256) == ({**tiny, "n_kv_head": 4}, "the model itself")


@pytest.mark.slow
@pytest.mark.parametrize("lr", [3e-3, 0.03, 0.1])
def test_probe_fails_the_unstable_lrs_of_the_tiny_model_and_passes_the_default(lr, shards_dir):
    cfg = compose(
        ["model=tiny", "model.qk_norm=false", f"optim.lr={lr}", "trainer=cpu", f"data.dir={shards_dir}"],
        config_name="doctor",
    )
    (row,) = check_lr_probe(cfg)
    if lr == 3e-3:
        assert row.status != FAIL, row
        assert "x1 lr 0.003: loss" in row.evidence and "UNSTABLE" not in row.evidence.split("x1 lr")[1].split(";")[0]
        return
    assert row.status == FAIL, row
    assert f"optim.lr={lr:g} is in the unstable region" in row.evidence
    assert "max attention logit" in row.evidence and " s: " in row.evidence  # the cause, and the cost
    largest = float(row.fix.split("optim.lr<=")[1].split(" ")[0])
    assert largest < lr
    assert f"model.qk_norm=true makes lr {lr:.3g} stable (probed)" in row.fix
