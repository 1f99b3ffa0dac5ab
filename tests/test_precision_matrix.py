"""Every callbacks preset x precision trains, validates, checkpoints and resumes on the CPU.

This is the short matrix CI runs on every push: the path a test machine happens to take for
`precision=auto` is never the only one exercised (users' CPUs and GPUs take bf16).
"""

import math

import pytest

from steadylm.train import train

PRECISIONS = ["32-true", "bf16-mixed"]  # 16-mixed needs a CUDA GPU; on a CPU it is refused (test_bad_inputs)
CALLBACKS = ["default", "minimal", "none"]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("callbacks", CALLBACKS)
def test_trains_validates_checkpoints_and_resumes(make_cfg, tmp_path, precision, callbacks):
    common = (
        f"trainer.precision={precision}",
        f"callbacks={callbacks}",
        "trainer.val_check_interval=4",
        "data.val_windows=16",
        "optim.warmup_steps=2",
        "optim.total_steps=8",  # one schedule for the 4 steps and their resume to 8
    )
    metrics, objects = train(make_cfg(*common, "trainer.max_steps=4"))
    trainer = objects["trainer"]
    assert trainer.global_step == 4 and trainer.precision == precision
    assert math.isfinite(metrics["val/loss"]) and metrics["val/loss"] < math.log(320)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    if callbacks == "none":  # no checkpoint callback: save the way a user's own code would
        ckpt.parent.mkdir(parents=True)
        trainer.save_checkpoint(ckpt)
    assert ckpt.is_file()
    metrics, objects = train(make_cfg(*common, "trainer.max_steps=8", f"ckpt_path={ckpt}", out=tmp_path / "resumed"))
    assert objects["trainer"].global_step == 8 and math.isfinite(metrics["val/loss"])
