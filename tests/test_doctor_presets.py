"""Doctor passes every shipped model preset and reference experiment on its defaults.

Only what is about this machine changes: the test shards (bytes tokenizer), a CPU instead of the
GPUs the recipes name, and a host with 80 GiB of RAM, so the memory row judges the preset, not the CI box.
The divergence experiments are not here: they are broken on purpose, and doctor flagging them is tested
in `test_doctor.py`.
"""

import pytest

from steadylm.config import compose
from steadylm.doctor import run_checks
from steadylm.doctor.check import FAIL

FAST = ["tiny", "llama_tiny"]
SLOW = ["small", "llama_small", "medium", "large", "llama_1b"]
EXPERIMENTS = ["gpt2_124m", "llama_124m", "fast"]


def doctor_rows(shards_dir, tmp_path, monkeypatch, *overrides):
    monkeypatch.setattr("steadylm.memory.ram_available", lambda: 80 * 2**30)
    cfg = compose(
        [
            *overrides,
            "trainer.accelerator=cpu",
            "trainer.devices=1",
            "trainer.precision=32-true",
            "data.tokenizer=bytes",
            f"data.dir={shards_dir}",
            f"paths.output_dir={tmp_path}",
        ]
    )
    return run_checks(cfg, out_dir=tmp_path / "doctor")


def assert_passes(rows):
    failed = [r for r in rows if r.status == FAIL]
    assert not failed, failed
    fixes = " ".join(r.fix for r in rows)
    assert "use model.init=gpt2" not in fixes  # the presets use it: advice never names the setting in use


@pytest.mark.parametrize("preset", FAST)
def test_model_preset_passes_doctor(preset, shards_dir, tmp_path, monkeypatch):
    assert_passes(doctor_rows(shards_dir, tmp_path, monkeypatch, f"model={preset}"))


@pytest.mark.slow
@pytest.mark.parametrize("preset", SLOW)
def test_large_model_preset_passes_doctor(preset, shards_dir, tmp_path, monkeypatch):
    """At 32 positions: what the model rows judge at init (loss vs ln V, grad norm against the shape's ceiling,
    activation RMS by depth) depends on width, depth and vocabulary, not on the context length, and a full
    1024-2048-token forward and backward of a 1B model takes minutes on a CPU."""
    rows = doctor_rows(
        shards_dir, tmp_path, monkeypatch, f"model={preset}", "model.context_length=32", "data.batch_size=1"
    )
    assert_passes(rows)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_reference_experiment_passes_doctor(experiment, shards_dir, tmp_path, monkeypatch):
    rows = doctor_rows(
        shards_dir,
        tmp_path,
        monkeypatch,
        f"experiment={experiment}",
        "compile=false",
        "data.num_workers=0",
        "data.pin_memory=false",
        "data.batch_size=2",
        "model.context_length=32",  # as above: the init checks do not depend on it
        "data.global_batch_tokens=512",
    )
    assert_passes(rows)
