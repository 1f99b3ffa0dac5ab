"""`model.activation_checkpointing`: keep less of a block's forward for backward and compute it again there, trading
step time for activation memory (docs/scaling.md). `blocks` keeps each block's input alone and re-runs the whole
block; `selective` keeps what the matmuls and attention produce and re-runs only the elementwise ops between them
(norms, activations, residual adds), whose recompute is cheap and whose outputs are most of the bytes. The gradients
are those of `none`: the same ops on the same inputs (dropout's RNG state is replayed)."""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from steadylm.compat import ATTENTION_OPS

MODES = ("none", "blocks", "selective")

aten = torch.ops.aten
# What `selective` keeps: the outputs of the matmuls (a linear layer is mm or addmm once dispatched) and of attention.
KEEP = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, *ATTENTION_OPS}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def run_block(block: torch.nn.Module, mode: str, *args) -> torch.Tensor:
    """`block(*args)`, its activations kept as `mode` says (all of them without autograd, as in validation)."""
    if mode == "none" or not torch.is_grad_enabled():
        return block(*args)
    if mode == "selective":
        context = functools.partial(create_selective_checkpoint_contexts, _keep_matmuls)
        return checkpoint(block, *args, use_reentrant=False, context_fn=context)
    return checkpoint(block, *args, use_reentrant=False)
