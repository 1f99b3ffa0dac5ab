"""Every model preset starts at an LR its own doctor passes, with both optimizers and QK-norm on or off: the config
checks, the coordinate check and the LR probe on a tiny proxy (muP based at the full width carries the LR down to
it, and the rule's tokens term to its batch), which must FAIL the same preset at 10x its default AdamW LR, or 30x
its Muon LR (Muon's rule is a bound: on `llama_1b` 10x is still stable). The default LR is the rule's at the model's
width and tokens a step, through any shape override, and the docs' preset table states what the configs compose."""

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


# Every preset at its defaults (QK-norm off) under both optimizers; QK-norm on, which changes the probe's logits and
# not the LR, on the two families' small presets (each larger preset's probe is the same proxy at another LR).
CASES = [(p, o, "false") for p in PRESETS for o in ("adamw", "muon")]
CASES += [(p, o, "true") for p in ("tiny", "llama_tiny") for o in ("adamw", "muon")]


@pytest.mark.slow
@pytest.mark.parametrize(("preset", "optim", "qk_norm"), CASES)
def test_preset_default_lr_passes_doctor_and_far_above_it_fails(preset, optim, qk_norm, shards_dir):
    cfg = doctor_cfg(shards_dir, preset, optim, f"model.qk_norm={qk_norm}")
    assert cfg.model.parametrization == "sp"  # the LR from the rule at the preset's width
    failed = [r for r in config_checks(cfg) if r.status == FAIL]
    assert not failed, failed
    (coords,) = check_coords(cfg, data_checks(cfg, False)[1])  # the family's proxy at widths 64-256, on real text
    assert coords.status != FAIL, coords
    (row,) = check_lr_probe(cfg)
    assert row.status != FAIL, row
    assert "x1 lr" in row.evidence and "UNSTABLE" not in row.evidence.split("x1 lr")[1].split(";")[0], row
    if qk_norm == "true":  # QK-norm bounds the logits the probe watches; its loss-only verdict is test_lr_probe's
        return
    high = doctor_cfg(shards_dir, preset, optim, f"optim.lr={(30 if optim == 'muon' else 10) * cfg.optim.lr}")
    (row,) = check_lr_probe(high)
    assert row.status == FAIL, row


@pytest.mark.slow
def test_small_with_muon_passes_doctors_own_probe_at_its_defaults(shards_dir):
    """`python -m steadylm.doctor model=small optim=muon data.batch_size=4` with doctor's own probe (4 layers x 128
    on 4 x 128 tokens): its default LR is stable there, the probe carrying it to its smaller batch by the rule."""
    cfg = compose(
        ["model=small", "optim=muon", "trainer=cpu", f"data.dir={shards_dir}", "data.batch_size=4"],
        config_name="doctor",
    )
    fill_derived(cfg)
    (row,) = check_lr_probe(cfg)
    assert row.status != FAIL, row
    scale = (4 * 128 / (4 * 1024)) ** cfg.optim.lr_rule.tokens_exponent
    assert (
        f"optim.lr x{scale:.3g}: the LR rule's tokens term from the run's 4,096 tokens a step to the probe's 512"
        in row.evidence
    )


def test_the_default_lr_follows_the_rule_through_every_shape_override_and_an_explicit_lr_wins():
    """The width, the batch, the context, the accumulation, the devices and a global batch each move the LR by the
    rule's terms; mup reads its base width; `optim.lr=X` replaces the rule and min_lr follows it."""
    lr = lambda *o: compose(["trainer=cpu", *o]).optim.lr  # noqa: E731
    rule = compose().optim.lr_rule
    assert (rule.width, rule.tokens) == (128, 2048) and lr("model=tiny") == rule.lr  # at tiny's own shape, 16 x 128
    assert rule.width_exponent < 0 and rule.tokens_exponent > 0  # sp's best LR falls with width, rises with batch
    at = lambda width, tokens: float(
        f"{rule.lr * (width / 128) ** rule.width_exponent * (tokens / 2048) ** rule.tokens_exponent:.3g}"
    )  # noqa: E731
    for width in (256, 512, 768, 2048):
        assert lr("model=tiny", f"model.d_model={width}") == at(width, 2048)
    assert (
        lr("model=tiny", "data.batch_size=64")
        == at(128, 8192)
        > lr("model=tiny")
        > lr("model=tiny", "data.batch_size=4")
    )
    assert lr("model=tiny", "model.context_length=512") == at(128, 8192)
    assert lr("model=tiny", "trainer.accumulate_grad_batches=4") == at(128, 8192)
    assert lr("model=tiny", "trainer.devices=4") == at(128, 8192)  # 4 CPU processes: 4 x 2,048 tokens a step
    assert lr("model=tiny", "data.global_batch_tokens=524288") == at(128, 524288)  # whatever the batch and devices
    assert lr("model=small") == at(768, 16 * 1024)  # the width and the tokens decide, not the preset's name
    assert lr("model=tiny", "model.d_model=768", "model.context_length=1024") == lr("model=small")
    assert lr("model=small", "model.parametrization=mup") == at(128, 16 * 1024)  # muP: the LR at its base width
    assert lr("model=small", "optim.lr=1e-3") == 1e-3 and compose(["model=small", "optim.lr=1e-3"]).optim.min_lr == 1e-4
    # docs/model.md's numbers: tiny at 64 x 128, and the rule carried to 524,288 tokens a step
    assert lr("model=tiny", "data.batch_size=64") == 2.3e-3 and lr("model=small", "optim=muon") == 4.1e-3
    assert lr("model=small", "data.global_batch_tokens=524288") == 5.8e-4
    assert lr("model=llama_1b", "data.global_batch_tokens=524288") == pytest.approx(2.2e-4, rel=0.02)
    muon = compose(["optim=muon"]).optim.lr_rule
    assert lr("model=tiny", "optim=muon") == muon.lr == 2e-2
    assert lr("model=tiny", "optim=muon", "model.d_model=512") == float(f"{2e-2 * 4**muon.width_exponent:.3g}")


def test_doctor_says_where_the_lr_came_from():
    from steadylm.lr_rule import explain

    cfg = compose(["model=tiny", "trainer=cpu", "model.d_model=256", "data.batch_size=32"])
    assert explain(cfg) == (
        f"optim.lr {cfg.optim.lr:.3g} from optim.lr_rule: 0.002 × (width 256 / 128)^{cfg.optim.lr_rule.width_exponent:g} × "
        f"(4,096 / 2,048 tokens)^{cfg.optim.lr_rule.tokens_exponent:g} = {cfg.optim.lr:.3g}; batch 32 × context 128 = 4,096 tokens a step"
    )
    cfg = compose(["model=tiny", "trainer=cpu", "optim.lr=1e-3", "data.global_batch_tokens=8192"])
    assert explain(cfg).startswith("optim.lr 0.001 set explicitly (optim.lr_rule would give 0.002 × (width 128 / 128)")
    assert explain(cfg).endswith("; data.global_batch_tokens 8,192)")


def test_the_docs_preset_table_states_each_presets_default_lr():
    rows = re.findall(r"^\| `(\w+)` \|.*\| ([\d.e-]+) \|$", (ROOT / "docs" / "model.md").read_text(), re.M)
    stated = {preset: float(lr) for preset, lr in rows if preset in PRESETS}
    assert set(stated) == set(PRESETS), stated
    assert stated == {p: compose([f"model={p}", "trainer.devices=1"]).optim.lr for p in PRESETS}
