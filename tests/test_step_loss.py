"""The training loss weighs every token of an optimizer step the same: the step's gradient is the mean over its valid
targets (every micro-batch, every rank), so one step cut into 16 x 1, 4 x 4 or 2 ranks x 2 x 4 micro-batches gives the
same gradient when `data.align=doc` pads some of them more than others; `train/loss` is the step's token mean."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch

from steadylm.model.gpt import IGNORE_INDEX
from tests.helpers import fit, run_cli
from tests.test_align import _doc_shards

# Short documents at T=16: about a third of the targets are padding, unevenly spread over a step's windows.
DOC_DATA = ["data.align=doc", "model.context_length=16", "trainer.max_steps=2", "optim.warmup_steps=1"]
DOC_DATA += ["trainer.limit_val_batches=0", "callbacks=minimal", "trainer.log_every_n_steps=1"]


class Grads(L.Callback):
    """Each optimizer step's gradients (as the optimizer gets them, before clipping) and each micro-batch's count of
    valid targets; with `out`, rank 0 saves them there."""

    def __init__(self, out: str | None = None):
        self.grads, self.valid, self.out = [], [], out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.valid.append(int((batch[1] != IGNORE_INDEX).sum()))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.named_parameters()})

    def on_train_end(self, trainer, pl_module):
        if self.out and trainer.is_global_zero:
            torch.save(self.grads, self.out)


@pytest.fixture
def doc_dir(tmp_path) -> Path:
    d = tmp_path / "docs"
    _doc_shards(d, "train", [[5, 16, 15, 17, 40, 1, 3, 30] * 4, [33, 2, 64, 9] * 4])
    _doc_shards(d, "val", [[50, 3, 80]])
    return d


def _same(a: list[dict], b: list[dict]) -> None:
    """The first step's gradient (the same weights) within 1e-6 of its norm (fp32 sums in another order)."""
    flat_a, flat_b = (torch.cat([g.flatten() for g in s.values()]) for s in (a[0], b[0]))
    assert (flat_a - flat_b).norm() <= 1e-6 * flat_a.norm(), float((flat_a - flat_b).norm() / flat_a.norm())


def test_one_step_as_16x1_or_4x4_micro_batches_gives_the_same_gradient(make_cfg, doc_dir):
    whole, cut = Grads(), Grads()
    a = fit(make_cfg(*DOC_DATA, f"data.dir={doc_dir}", "data.batch_size=16"), whole)
    b = fit(make_cfg(*DOC_DATA, f"data.dir={doc_dir}", "data.batch_size=4", "trainer.accumulate_grad_batches=4"), cut)
    assert len(set(cut.valid)) > 1  # the micro-batches hold different counts of targets: a mean of means would differ
    _same(whole.grads, cut.grads)
    assert a["trainer"].callback_metrics["train/loss"].item() == pytest.approx(
        b["trainer"].callback_metrics["train/loss"].item(), rel=1e-6
    )


@pytest.mark.slow
def test_two_ranks_of_two_micro_batches_give_the_gradient_of_one_rank(make_cfg, doc_dir, tmp_path):
    """DDP, 2 ranks x 4 windows x 2 micro-batches (its blocks recomputed in backward) against 1 rank x 16 x 1."""
    one = Grads()
    ref = fit(make_cfg(*DOC_DATA, f"data.dir={doc_dir}", "data.batch_size=16"), one)
    out = tmp_path / "grads.pt"
    tiny = ["model.n_layer=2", "model.n_head=2", "model.d_model=64", "model.mup_base_width=64"]
    tiny += ["model.mup_base_head_dim=32", "optim.lr_rule.width=64", "optim.lr_rule.tokens_exponent=0"]
    tiny += ["trainer.precision=32-true"]
    tiny += ["trainer.enable_progress_bar=false"]
    proc = run_cli(
        "trainer=ddp_sim", *tiny, *DOC_DATA, f"data.dir={doc_dir}", "data.batch_size=4",
        "trainer.accumulate_grad_batches=2", f"+callbacks.grads={{_target_: test_step_loss.Grads, out: {out}}}",
        "model.activation_checkpointing=blocks",  # recomputed under DDP: the same gradient
        f"hydra.run.dir={tmp_path / 'ddp'}", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    _same(one.grads, torch.load(out))
    result = json.loads((tmp_path / "ddp" / "result.json").read_text())  # the last step's token mean, all ranks
    assert result["train_loss"] == pytest.approx(ref["trainer"].callback_metrics["train/loss"].item(), rel=1e-6)
