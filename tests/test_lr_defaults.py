"""Every model preset starts at an LR its own doctor passes, with both optimizers and QK-norm on or off: the config
checks, the coordinate check and the LR probe on a tiny proxy (muP carries the LR down to it), which must FAIL the
same preset at 10x its default LR."""

from __future__ import annotations

import pytest

from steadylm.config import compose
from steadylm.doctor.check import FAIL
from steadylm.doctor.config_checks import config_checks
from steadylm.doctor.coord_check import check_coords
from steadylm.doctor.data_checks import data_checks
from steadylm.doctor.lr_probe import check_lr_probe
from steadylm.resolve import fill_derived

PRESETS = ["tiny", "llama_tiny", "small", "medium", "large", "llama_small", "llama_1b"]
TINY_PROBE = ["probe.max_layers=2", "probe.max_width=64", "probe.max_context=32", "probe.batch_size=8"]


def doctor_cfg(shards_dir, preset: str, optim: str, *extra: str):
    cfg = compose(
        [f"model={preset}", f"optim={optim}", "trainer=cpu", f"data.dir={shards_dir}", *TINY_PROBE, *extra],
        config_name="doctor",
    )
    fill_derived(cfg)  # as doctor does: the null vocabulary from the shards, the warmup from the run length
    return cfg


@pytest.mark.slow
@pytest.mark.parametrize("qk_norm", ["false", "true"])
@pytest.mark.parametrize("optim", ["adamw", "muon"])
@pytest.mark.parametrize("preset", PRESETS)
def test_preset_default_lr_passes_doctor_and_ten_times_it_fails(preset, optim, qk_norm, shards_dir):
    cfg = doctor_cfg(shards_dir, preset, optim, f"model.qk_norm={qk_norm}")
    assert cfg.model.parametrization == "mup"  # the LR tuned at tiny is every preset's
    failed = [r for r in config_checks(cfg) if r.status == FAIL]
    assert not failed, failed
    (coords,) = check_coords(cfg, data_checks(cfg, False)[1])  # the family's proxy at widths 64-256, on real text
    assert coords.status != FAIL, coords
    (row,) = check_lr_probe(cfg)
    assert row.status != FAIL, row
    assert "x1 lr" in row.evidence and "UNSTABLE" not in row.evidence.split("x1 lr")[1].split(";")[0], row
    if qk_norm == "true":  # QK-norm bounds the logits the probe watches; its loss-only verdict is test_lr_probe's
        return
    high = doctor_cfg(shards_dir, preset, optim, f"optim.lr={10 * cfg.optim.lr}")
    (row,) = check_lr_probe(high)
    assert row.status == FAIL, row
