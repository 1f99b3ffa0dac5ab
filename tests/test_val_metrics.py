"""`val/loss` and `val/bpb` equal a brute-force token-weighted mean over the whole val split,
whatever the batch size, a padded last batch, and the number of ranks (real gloo DDP for 2)."""

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from steadylm.data.datamodule import ShardDataModule
from steadylm.module import LMModule

MODEL = dict(n_layer=1, n_head=2, d_model=32, context_length=64, vocab_size=320)
OPTIM = dict(lr=1e-3, min_lr=1e-4, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, warmup_steps=1, total_steps=10)


def brute_force(module: LMModule, windows) -> float:
    """Sum of every target's cross-entropy over every val window, one window at a time, / their count."""
    total, count = 0.0, 0
    module.eval()
    with torch.no_grad():
        for i in range(len(windows)):
            x, y = windows[i]
            total += float(F.cross_entropy(module(x[None])[0], y, ignore_index=-100, reduction="sum"))
            count += int((y != -100).sum())
    return total / count


@pytest.mark.parametrize("devices,batch_size", [(1, 48), (1, 500), (2, 48)])
def test_val_loss_is_the_exact_token_mean(shards_dir, tmp_path, devices, batch_size):
    dm = ShardDataModule(shards_dir, batch_size=batch_size, context_length=64, model_vocab_size=320)
    dm.setup("fit")
    n = len(dm.val_set)
    assert n % (batch_size * devices), "the case must end on a padded batch"
    torch.manual_seed(0)
    module = LMModule(model=MODEL, optim=OPTIM, val_bytes_per_token=dm.bytes_per_token)
    expected = brute_force(module, dm.val_set)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp_spawn" if devices > 1 else "auto",
        precision="32-true",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
        limit_val_batches=1.0,
        default_root_dir=tmp_path,
    )
    metrics = trainer.validate(module, datamodule=dm, verbose=False)[0]
    assert metrics["val/loss"] == pytest.approx(expected, rel=1e-5)
    if module.val_bytes_per_token is not None:
        assert metrics["val/bpb"] == pytest.approx(expected / math.log(2) / module.val_bytes_per_token, rel=1e-5)
