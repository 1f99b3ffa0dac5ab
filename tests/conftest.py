"""Shared fixtures: real shards from a slice of the embedded corpus, and the real composed config."""

from __future__ import annotations

import os

# One BLAS/OpenMP thread per process: DDP tests run several processes on 2 cores, and oversubscribed
# torch thread pools made a 12-step tiny run ~20x slower. Subprocesses inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from steadylm.config import compose  # noqa: E402
from steadylm.data.prepare import prepare  # noqa: E402
from steadylm.errors import DataError  # noqa: E402
from steadylm.resolve import fill_derived  # noqa: E402

torch.set_num_threads(1)

# Small enough for seconds per run, large enough that loss visibly falls.
TINY_OVERRIDES = [
    "trainer=cpu",
    "trainer.precision=32-true",  # the path every machine has; tests about bf16 or fp16 set their own
    "model.n_layer=2",
    "model.n_head=2",
    "model.d_model=64",
    "model.mup_base_width=64",  # based at itself, so mup is sp bit for bit and the tests' pinned numbers hold
    "model.mup_base_head_dim=32",
    "optim.lr_rule.width=64",  # the rule's LR (2e-3; Muon 2e-2) at this width, as the tests' numbers were pinned
    "optim.lr_rule.tokens_exponent=0",  # ... whatever their batch
    "model.context_length=64",
    "data.batch_size=8",
    "trainer.max_steps=30",
    "trainer.val_check_interval=15",
    "data.val_windows=32",
    "trainer.log_every_n_steps=5",
    "trainer.enable_progress_bar=false",
    "optim.warmup_steps=5",
    "callbacks.checkpoint.every_n_train_steps=15",
]


@pytest.fixture(scope="session")
def shards_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards")
    prepare(input=None, out_dir=out, max_bytes=400_000, val_fraction=0.05, progress=False)
    return out


@pytest.fixture
def make_cfg(shards_dir, tmp_path):
    """Compose the real train config, shrunk to tiny CPU sizes, writing into tmp_path."""

    def _make(*overrides: str, out: Path | None = None) -> DictConfig:
        out = out or tmp_path / "run"
        base = TINY_OVERRIDES
        if "callbacks=none" in overrides:  # no checkpoint callback to configure
            base = [o for o in base if not o.startswith("callbacks.")]
        cfg = compose([*base, f"data.dir={shards_dir}", f"paths.output_dir={out}", *overrides])
        try:
            fill_derived(cfg)  # as startup does: the null vocabulary from the DataModule, warmup from the run length
        except DataError:
            pass  # shards broken on purpose: the code under test reports it
        return cfg

    return _make
