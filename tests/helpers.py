"""What several test files share: the tiny command-line overrides and a real `python train.py` subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np

ROOT = Path(__file__).resolve().parents[1]

# A 1-layer model that trains a few steps in seconds, for runs through the real command line.
CLI_TINY = [
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    "model.context_length=32",
    "data.batch_size=4",
    "trainer.max_steps=6",
    "optim.warmup_steps=2",
    "trainer.val_check_interval=3",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
]

# Two CPU processes over gloo, with a short collective timeout so a hang fails the test instead of stalling it.
DDP_TWO_CPU = [
    "trainer=cpu",
    "trainer.devices=2",
    "trainer.strategy={_target_: lightning.pytorch.strategies.DDPStrategy, "
    "timeout: {_target_: datetime.timedelta, seconds: 60}}",
]


def run_cli(
    *args: str, cwd: Path, timeout: int = 400, module: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python train.py ARGS` (or `python -m MODULE ARGS`) in `cwd`, as a user runs it; tests/ importable;
    `env` adds to (or overrides) the environment."""
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), str(ROOT / "tests"), *sys.path])
    env = {**os.environ, "PYTHONPATH": path, "STEADYLM_ROOT": str(cwd), "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("HYDRA_FULL_ERROR", None)
    command = [sys.executable, "-m", module] if module else [sys.executable, str(ROOT / "train.py")]
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def raw_shard(path: Path, data, attrs: dict | None = None, **create) -> None:
    """A shard written by hand (not by prepare), to break one thing: format-1 bytes attributes, then `attrs`
    (a None value leaves that attribute out); `create` goes to `create_dataset` (dtype, compression, chunks)."""
    with h5py.File(path, "w") as f:
        if data is not None:
            f.create_dataset("tokens", data=data, **create)
        base = {
            "format_version": 1,
            "vocab_size": 257,
            "eos_id": 256,
            "tokenizer": "bytes",
            "n_tokens": 0 if data is None else len(data),
            "max_token_id": 0 if data is None or not len(data) else int(np.max(data)),
        }
        for k, v in {**base, **(attrs or {})}.items():
            if v is not None:
                f.attrs[k] = v
