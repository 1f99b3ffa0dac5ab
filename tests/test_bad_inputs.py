"""Every mistake a user can make with data, config, environment or checkpoint: one `error:` line
naming the file/key and the fix, exit 2, no traceback, and every file already on disk unchanged.

The cases go through the real `main` (Hydra's command line, composition and run folder) in-process;
`test_cli_subprocess_reports_one_line` checks once that a real `python train.py` prints the same.
Disk full while writing shards is `test_shards.py::test_atomic_write_disk_full_leaves_no_file_and_keeps_existing`
(the partial shard is removed and nothing under a shard's name is left half-written).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from steadylm.config import set_key
from steadylm.train import main, train
from tests.helpers import raw_shard

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    "trainer=cpu",
    "model.n_layer=1",
    "model.n_head=2",
    "model.d_model=32",
    "optim.lr_rule.width=32",  # the rule's LR at this width: 2e-3, as the messages below say
    "optim.lr_rule.tokens_exponent=0",  # ... whatever the batch
    "model.context_length=32",
    "data.batch_size=4",
    "trainer.max_steps=2",
    "optim.warmup_steps=1",
    "trainer.enable_progress_bar=false",
    "callbacks.checkpoint.every_n_train_steps=2",
]


@pytest.fixture(autouse=True)
def restore_logging():
    """Hydra's `main` installs root log handlers bound to pytest's captured stderr; drop them after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)


def snapshot(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def assert_unchanged(before: dict[str, str], root: Path) -> None:
    after = snapshot(root)
    changed = [p for p, h in before.items() if after.get(p) != h]
    assert not changed, f"pre-existing files changed or removed: {changed}"


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", ["train.py", *args])
    # a handler an earlier in-process test left on a captured stream, now closed, would print logging's own
    # "--- Logging error ---" traceback into this capture: not the command's output
    monkeypatch.setattr(logging, "raiseExceptions", False)
    with pytest.raises(SystemExit) as exit_info:
        main()
    return exit_info.value.code, capsys.readouterr().err


def assert_one_clear_error(code: int, err: str, pattern: str) -> None:
    import re

    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert code == 2, err[-2000:]
    assert "Traceback" not in err, err[-3000:]
    assert len(lines) == 1, err[-2000:]
    assert re.search(pattern, lines[0]), lines[0]


# --- data: each builds a shard folder from the real fixture shards, then breaks one thing ---------


def _raw(path: Path, data, **attrs) -> None:
    raw_shard(path, data, attrs)


def _truncate(d: Path) -> None:
    p = d / "train-00000.h5"
    p.write_bytes(p.read_bytes()[:4096])


def _only_short_train(d: Path) -> None:
    (d / "train-00000.h5").unlink()
    _raw(d / "train-00000.h5", np.arange(20, dtype=np.uint16))


DATA_CASES = {
    "missing_dir": (lambda d: shutil.rmtree(d), [], r"shards.*data\.dir does not exist; run `make data`"),
    "empty_shard": (lambda d: _raw(d / "train-00001.h5", np.zeros(0, np.uint16)), [], r"train-00001\.h5.*empty"),
    "truncated": (_truncate, [], r"train-00000\.h5: not a readable HDF5 file \(truncated or corrupt"),
    "no_tokens_dataset": (lambda d: _raw(d / "train-00001.h5", None), [], r"train-00001\.h5: has no 'tokens' dataset"),
    "float_tokens": (
        lambda d: _raw(d / "train-00001.h5", np.arange(99, dtype=np.float32)),
        [],
        r"train-00001\.h5.*dtype float32.*unsigned",
    ),
    "oov_ids": (
        lambda d: _raw(d / "train-00001.h5", np.array([1, 300, 2], np.uint16), vocab_size=257),
        [],
        r"train-00001\.h5: max_token_id 300 >= vocab_size 257",
    ),
    "format_version": (
        lambda d: _raw(d / "train-00001.h5", np.arange(99, dtype=np.uint16), format_version=3),
        [],
        r"train-00001\.h5: format_version 3 is not supported",
    ),
    "too_short": (_only_short_train, [], r"train-00000\.h5.*20 tokens, fewer than model\.context_length \+ 1 = 33"),
    "val_missing": (
        lambda d: (d / "val-00000.h5").unlink(),
        [],
        r"no val shards \(val-\*\.h5\) found; run `make data`",
    ),
    "vocab_too_small": (
        lambda d: None,
        ["model.vocab_size=128"],
        r"train-00000\.h5: shard vocab_size 257 exceeds model\.vocab_size 128; set model\.vocab_size >= 257",
    ),
    "context_mismatch": (
        lambda d: None,
        ["data.context_length=16"],
        r"data\.context_length=16 differs from model\.context_length=32",
    ),
}


@pytest.mark.parametrize("case", list(DATA_CASES))
def test_bad_data_and_config(case, shards_dir, tmp_path, monkeypatch, capsys):
    breaker, extra, pattern = DATA_CASES[case]
    data = tmp_path / "shards"
    shutil.copytree(shards_dir, data)
    breaker(data)
    before = snapshot(tmp_path)
    code, err = run_main(monkeypatch, capsys, *TINY, f"data.dir={data}", f"hydra.run.dir={tmp_path / 'run'}", *extra)
    assert_one_clear_error(code, err, pattern)
    assert_unchanged(before, tmp_path)
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- the command line and the environment ---------------------------------------------------------

CLI_CASES = {
    "unknown_preset": (
        ["model=huge"],
        r"Could not find 'model/huge'; available: large, llama_1b, llama_small, llama_tiny, medium, small, tiny",
    ),
    "typo_override": (
        ["trainer.max_stepz=3"],
        r"trainer\.max_stepz is not a config key; did you mean trainer\.max_steps\b.*\+trainer\.max_stepz=",
    ),
    "bad_override_syntax": (["model.n_layer=["], r"no viable alternative at input '\['"),
    "too_many_gpus": (
        ["trainer.accelerator=gpu", "trainer.devices=64"],
        r"trainer\.(accelerator=gpu but no CUDA GPU is visible|devices=64 asks for 64 GPUs)",
    ),
    "run_dir_unwritable": (
        ["hydra.run.dir={file}/run"],
        r"cannot create .*a-file/run \(Not a directory\); pass hydra\.run\.dir=",
    ),
    "output_dir_unwritable": (
        ["paths.output_dir={file}/out"],
        r"paths\.output_dir=.*a-file/out is not writable \(Not a directory\)",
    ),
    "resume_bogus": (["resume=yes"], r"resume=yes is not supported; use resume=auto"),
    "resume_and_ckpt": (["resume=auto", "ckpt_path=x.ckpt"], r"both ckpt_path and resume=auto are set"),
    "init_from_and_ckpt": (["init_from=a.ckpt", "ckpt_path=x.ckpt"], r"both ckpt_path and init_from are set"),
    "init_from_missing": (["init_from=nowhere.ckpt"], r"nowhere\.ckpt: checkpoint file not found"),
    "guard_action": (
        ["callbacks.stability.guard.action=bogus"],
        r"callbacks\.stability\.guard\.action='bogus' is not one of rollback, stop",
    ),
    "stability_bad_key": (
        ["+callbacks.stability.spike.sigmaa=5"],
        r"callbacks\.stability\.spike\.sigmaa is not a setting; use one of sigma, window",
    ),
    "stability_text_for_a_number": (
        ["callbacks.stability.signals.horizon=soon"],
        r"callbacks\.stability\.signals\.horizon='soon' must be a number \(default 25\)",
    ),
    "mup_off_base_with_xavier": (
        ["model=small", "model.parametrization=mup", "model.init=xavier"],
        r"model\.parametrization=mup needs model\.init=gpt2 off its base width, got 'xavier' at d_model=32",
    ),
    "callback_without_target": (
        ["+callbacks.guard.max_consecutive=2"],
        r"callbacks\.guard has no _target_, so nothing would run it",
    ),
    "guard_defer": (["callbacks.stability.defer=maybe"], r"callbacks\.stability\.defer='maybe' must be true or false"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_bad_command_line_and_environment(case, shards_dir, tmp_path, monkeypatch, capsys):
    args, pattern = CLI_CASES[case]
    blocker = tmp_path / "a-file"
    blocker.write_text("a file where a folder is expected")
    before = snapshot(tmp_path)
    args = [a.format(file=blocker) for a in args]
    code, err = run_main(
        monkeypatch, capsys, *TINY, f"data.dir={shards_dir}", f"hydra.run.dir={tmp_path / 'run'}", *args
    )
    assert_one_clear_error(code, err, pattern)
    assert_unchanged(before, tmp_path)


# --- bad values: every key a user sets, refused in one line before anything launches -------------------

VALUE_CASES = {
    "batch_size_0": (["data.batch_size=0"], r"data\.batch_size=0 is not allowed; it must be a whole number > 0"),
    "batch_size_text": (
        ["data.batch_size=abc"],
        r"data\.batch_size='abc' is not allowed; it must be a whole number > 0",
    ),
    "num_workers": (["data.num_workers=-1"], r"data\.num_workers=-1 is not allowed; it must be a whole number >= 0"),
    "n_head_does_not_divide": (
        ["model.n_head=3"],
        r"model\.d_model=32 .*model\.n_head=3|model\.n_head=3.*model\.d_model=32",
    ),
    "n_kv_head_does_not_divide": (["model.n_kv_head=3"], r"model\.n_kv_head=3"),
    "d_model_0": (["model.d_model=0"], r"model\.d_model=0"),
    "n_layer_0": (["model.n_layer=0"], r"model\.n_layer=0"),
    "precision_unknown": (
        ["trainer.precision=fp8"],
        r"trainer\.precision='fp8' is not allowed; it must be one of auto, 32-true",
    ),
    "fp16_on_a_cpu": (
        ["trainer.precision=16-mixed"],
        r"trainer\.precision=16-mixed \(fp16 with a loss scaler\) needs a CUDA GPU",
    ),
    "accelerator_unknown": (
        ["trainer.accelerator=tpu9"],
        r"trainer\.accelerator='tpu9' is not allowed; it must be one of auto, cpu",
    ),
    "muon_ns_coeffs": (
        ["optim=muon", "optim.muon.ns_coeffs=cubic"],
        r"optim\.muon\.ns_coeffs='cubic' is not allowed; it must be quintic \| polar_express",
    ),
    "lr_zero": (["optim.lr=0"], r"optim\.lr=0 is not allowed; it must be a learning rate > 0"),
    "lr_negative": (["optim.lr=-0.1"], r"optim\.lr=-0\.1 is not allowed"),
    "min_lr_above_lr": (
        ["optim.min_lr=1.0"],
        r"optim\.min_lr=1\.0 is not allowed; it must be between 0 and optim\.lr=0\.002",
    ),
    "warmup_not_below_max_steps": (
        ["optim.warmup_steps=2"],
        r"optim\.warmup_steps=2 is not allowed; it must be .*< optim\.total_steps=2",
    ),
    "max_steps_0": (
        ["trainer.max_steps=0"],
        r"trainer\.max_steps=0 is not allowed; it must be a whole number of optimizer steps > 0",
    ),
    "accumulate_0": (["trainer.accumulate_grad_batches=0"], r"trainer\.accumulate_grad_batches=0 is not allowed"),
    "devices_0": (["trainer.devices=0"], r"trainer\.devices=0 is not allowed"),
    "devices_text": (
        ["trainer.devices=two"],
        r"trainer\.devices='two' is not allowed; it must be auto, -1, a whole number > 0, or a list of distinct",
    ),
    "device_ids_on_a_cpu": (
        ["trainer.devices=[0,1]"],
        r"trainer\.devices=\[0, 1\] picks GPUs .* on the CPU, which takes a number of processes; set trainer\.devices=2",
    ),
    "betas": (
        ["optim.betas=[0.9,1.5]"],
        r"optim\.betas=\[0\.9, 1\.5\] is not allowed; it must be two numbers in \[0, 1\)",
    ),
    "clip_negative": (["trainer.gradient_clip_val=-1"], r"trainer\.gradient_clip_val=-1 is not allowed"),
    "pack_unknown": (["data.pack=window"], r"data\.pack='window' is not allowed; it must be none or doc"),
    "source_weight_negative": (
        ["data.sources={web: {dir: /nowhere, weight: -0.5}}"],
        r"data\.sources\.web\.weight=-0\.5 is not allowed; it must be a finite number >= 0",
    ),
    "source_weight_inf": (
        ["data.sources={web: {dir: /nowhere, weight: inf}}"],
        r"data\.sources\.web\.weight=inf is not allowed; it must be a finite number >= 0",
    ),
    "drop_last_epoch_under_a_step": (
        ["data.drop_last=true", "trainer.accumulate_grad_batches=100000"],
        r"data\.drop_last=true drops an epoch's last partial optimizer step, and the [\d,]+ train windows are fewer "
        r"than one step's 400,000 .*, so no step would run",
    ),
    "cpu_processes_by_accident": (
        ["trainer.accelerator=auto", "trainer.devices=4"],
        r"trainer\.devices=4 asks for 4 GPUs but 0 are visible on this machine; .*"
        r"trainer\.accelerator=cpu to run 4 CPU processes on purpose",
    ),
    "does_not_fit": (
        ["trainer.devices=4", "model.n_layer=48", "model.d_model=4096", "model.n_head=32"],
        r"this run does not fit: ~[\d.]+ GiB per process x 4 processes \(weights\+grads\+adamw .*\) vs "
        r"[\d.]+ GiB RAM available; not even data\.batch_size=1 with model\.activation_checkpointing=blocks fits: "
        r"fewer trainer\.devices",
    ),
}


@pytest.mark.parametrize("case", list(VALUE_CASES))
def test_bad_values_are_one_line_and_exit_2(case, shards_dir, tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available() and case in ("fp16_on_a_cpu", "cpu_processes_by_accident"):
        pytest.skip("about a machine without a GPU")
    args, pattern = VALUE_CASES[case]
    code, err = run_main(
        monkeypatch, capsys, *TINY, f"data.dir={shards_dir}", f"hydra.run.dir={tmp_path / 'run'}", *args
    )
    assert_one_clear_error(code, err, pattern)
    assert not (tmp_path / "run" / "checkpoints").exists()


# --- checkpoints ------------------------------------------------------------------------------------


class Payload:
    """Stands in for code smuggled into a checkpoint: unpickling it would import and call this module."""

    def __reduce__(self):
        return (os.getcwd, ())


def test_bad_checkpoints(make_cfg, tmp_path, monkeypatch, capsys):
    """One real checkpoint (d_model=64), then every way of pointing ckpt_path at the wrong thing."""
    good = tmp_path / "run" / "checkpoints" / "last.ckpt"
    train(make_cfg("trainer.max_steps=2", "optim.warmup_steps=1", "callbacks.checkpoint.every_n_train_steps=2"))
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    evil = ckpts / "evil.ckpt"
    torch.save({**torch.load(good, weights_only=True), "extra": Payload(), "fn": functools.partial(print)}, evil)
    truncated = ckpts / "truncated.ckpt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    cases = [
        (
            good,
            ["model.d_model=32"],
            r"last\.ckpt: was written for a different model shape \(shape mismatch \(checkpoint vs config\): "
            r"net\.wte\.weight \(320, 64\) vs \(320, 32\).*use the model overrides it was trained with: .*model\.d_model=64",
        ),
        (good, ["model.n_layer=3"], r"different model shape \(missing: net\.blocks\.2\."),
        (evil, [], r"evil\.ckpt: refused to load: it carries pickled code.*(getcwd|Payload|partial)"),
        (truncated, [], r"truncated\.ckpt: not a complete checkpoint \(truncated or corrupt\)"),
        (ckpts / "nope.ckpt", [], r"nope\.ckpt: checkpoint file not found"),
        (
            good,
            ["optim.warmup_steps=2"],
            r"last\.ckpt has 2 applied steps under cosine: warmup 1, .* would have given step 0 LR 0\.001, not "
            r"0\.002; resume with the checkpoint's optim\.schedule=cosine optim\.lr=0\.002 optim\.warmup_steps=1$",
        ),
    ]
    before = snapshot(tmp_path)
    run_dir = tmp_path / "resumed"
    for ckpt, extra, pattern in cases:
        overrides = ["trainer=cpu", "model.n_head=2", "model.d_model=64", "model.context_length=64", "model.n_layer=2"]
        overrides += ["optim.lr_rule.width=64", "optim.lr_rule.tokens_exponent=0"]  # the checkpoint's LR (conftest's)
        code, err = run_main(
            monkeypatch,
            capsys,
            *overrides,
            *extra,
            "trainer.enable_progress_bar=false",
            f"data.dir={make_cfg().data.dir}",
            f"hydra.run.dir={run_dir}",
            f"ckpt_path={ckpt}",
        )
        assert_one_clear_error(code, err, pattern)
        assert not (run_dir / "checkpoints").exists()
    assert_unchanged(before, tmp_path)


def test_compressed_shard_warns_and_trains(make_cfg, shards_dir, tmp_path):
    data = tmp_path / "shards"
    shutil.copytree(shards_dir, data)
    with h5py.File(shards_dir / "val-00000.h5", "r") as src, h5py.File(data / "val-00000.h5", "w") as dst:
        dst.create_dataset("tokens", data=src["tokens"][:], compression="gzip", chunks=(4096,))
        dst.attrs.update(dict(src.attrs))
    with pytest.warns(UserWarning, match=r"val-00000\.h5: tokens are gzip-compressed; random windows will be slow"):
        cfg = make_cfg("trainer.max_steps=2", "optim.warmup_steps=1")
        set_key(cfg, "data.dir", str(data))
        _, objects = train(cfg)
    assert objects["trainer"].global_step == 2


@pytest.mark.slow  # ~5 s of interpreter start-up alone; the cases above run the same `main` in-process
def test_cli_subprocess_reports_one_line(tmp_path):
    """The real `python train.py`: Hydra's own error for an unknown preset is one line, exit 2."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "STEADYLM_ROOT": str(tmp_path)}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "model=huge", "trainer.max_stepz=1"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: Could not find 'model/huge'; available: large, llama_1b, llama_small, llama_tiny, medium, small, tiny (see conf/)"
    ]
    assert not list(tmp_path.iterdir())  # nothing written
