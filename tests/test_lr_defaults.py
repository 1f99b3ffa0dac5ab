"""Every model preset starts at an LR its own doctor passes, with both optimizers and QK-norm on or off: the config
checks, the coordinate check and the LR probe on a tiny proxy (muP based at the full width carries the LR down to
it), which must FAIL the same preset at 10x its default LR. The default LR is the width rule's at the model's width,
through any shape override, and the docs' preset table states what the configs compose."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from steadylm.config import compose
from steadylm.doctor.check import FAIL
from steadylm.doctor.config_checks import config_checks
from steadylm.doctor.coord_check import check_coords
from steadylm.doctor.data_checks import data_checks
from steadylm.doctor.lr_probe import check_lr_probe
from steadylm.resolve import fill_derived

ROOT = Path(__file__).resolve().parents[1]
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
    assert cfg.model.parametrization == "sp"  # the LR from the width rule at the preset's width
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


def test_the_default_lr_follows_the_width_rule_through_a_shape_override_and_an_explicit_lr_wins():
    lr = lambda *o: compose(list(o)).optim.lr  # noqa: E731
    rule = compose().optim.width_rule
    assert rule.width == 128 and lr("model=tiny") == rule.lr  # anchored at tiny's own best
    assert rule.exponent < 0  # SP's best LR falls with width
    for width in (256, 512, 768, 2048):
        expected = rule.lr * (width / rule.width) ** rule.exponent
        assert lr("model=tiny", f"model.d_model={width}") == pytest.approx(expected, rel=5e-3)
    assert lr("model=tiny", "model.d_model=768") == lr("model=small")  # the width decides, not the preset's name
    assert lr("model=small", "model.parametrization=mup") == rule.lr  # muP: the LR tuned at its base width, 128
    assert lr("model=small", "model.parametrization=mup", "model.mup_base_width=768") == lr("model=small")
    assert lr("model=small", "optim.lr=1e-3") == 1e-3 and compose(["model=small", "optim.lr=1e-3"]).optim.min_lr == 1e-4
    assert lr("model=tiny", "optim=muon") == 2e-2 and lr("model=tiny", "optim=muon", "model.d_model=512") == 1e-2


def test_the_docs_preset_table_states_each_presets_default_lr():
    rows = re.findall(r"^\| `(\w+)` \|.*\| ([\d.e-]+) \|$", (ROOT / "docs" / "model.md").read_text(), re.M)
    stated = {preset: float(lr) for preset, lr in rows if preset in PRESETS}
    assert set(stated) == set(PRESETS), stated
    assert stated == {p: compose([f"model={p}"]).optim.lr for p in PRESETS}
