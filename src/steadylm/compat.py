"""Every private attribute of Lightning, torch or OmegaConf that steadylm touches, each exercised by
`tests/test_compat.py`: an upgrade that moves one breaks this file and one test, never a run halfway through."""

from __future__ import annotations

from typing import Any

import torch


def cpu_has_bf16() -> bool:
    """oneDNN's own answer: the CPU runs torch's bf16 kernels (AVX-512 BW/VL/DQ on x86); torch has no public query."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


# Fused per-tensor kernels torch has no public name for; aliases, not wrappers, so a step calls no function of ours.
foreach_norm = torch._foreach_norm  # the L2 norm of each tensor of a list
sub_tensors = torch._foreach_sub  # `a[i] - b[i]` for every i
scale_tensors = torch._foreach_mul_  # `a[i] *= s` for every i, in place (`s` may be a device scalar)


def per_tensor_norms(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of each tensor, as one 1-D fp32 tensor."""
    return torch.stack(foreach_norm(tensors)).float()


def copy_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """A copy of each tensor in one fused kernel (`torch._foreach_mul` by 1; no public foreach copy-out)."""
    return torch._foreach_mul(tensors, 1.0)


def logged_step(trainer: Any) -> int:
    """The step number Lightning's own `self.log` writes this batch's metrics at."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def batches_processed(trainer: Any) -> int:
    """Training batches the fit loop has finished this epoch (the sampler itself runs ahead by prefetch)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


def attached_trainer(module: Any) -> Any | None:
    """The Trainer a LightningModule is attached to, or None (`module.trainer` raises when there is none)."""
    return module._trainer


# GradScaler's undocumented protocol with the fused optimizers: every later `step()` skips itself on the device
# (weights, moments and step counts left alone) while this attribute, a 0-dim float written in place, is 1.
FOUND_INF = "found_inf"


def set_found_inf(optimizer: Any, flag: torch.Tensor) -> None:
    setattr(optimizer, FOUND_INF, flag)


def read_found_inf(optimizer: Any) -> torch.Tensor | None:
    return getattr(optimizer, FOUND_INF, None)


def clear_found_inf(optimizer: Any) -> None:
    optimizer.__dict__.pop(FOUND_INF, None)


def every_n_train_steps(checkpoint_callback: Any) -> int:
    """ModelCheckpoint's save period in training steps (0 when it saves on another rule)."""
    return int(getattr(checkpoint_callback, "_every_n_train_steps", 0) or 0)


def pg_timeout(strategy: Any) -> Any:
    """The process-group timeout a Lightning strategy was given (a `timedelta`), for a group of our own beside it."""
    return strategy._timeout


def saves_sharded(strategy: Any) -> bool:
    """`ModelParallelStrategy` writes a distributed checkpoint (each rank its shards), not one gathered file."""
    return bool(strategy._save_distributed_checkpoint)


def set_loss_scale(scaler: torch.amp.GradScaler, value: float) -> None:
    """Force the fp16 loss scale, also before the first step, when `update(new_scale=)` has no scale yet."""
    if scaler._scale is not None:
        scaler.update(new_scale=float(value))
    else:
        scaler._init_scale = float(value)


def checkpoint_batches(checkpoint: dict) -> dict | None:
    """The fit loop's micro-batch counters in a checkpoint (`_BatchProgress.state_dict()`: `current`, `total`), None if
    absent; a resume on another machine size rewrites them before Lightning restores its loops (data/position.py)."""
    return checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")


def ends_step(trainer: Any) -> bool:
    """The micro-batch under way is the last of its optimizer step (the fit loop's own test, valid from the batch's
    `training_step` to its `on_after_backward`)."""
    return not trainer.fit_loop.epoch_loop._should_accumulate()


# The fused attention kernels' aten ops (torch names them privately), whose outputs selective activation
# checkpointing keeps (model/recompute.py); those this build lacks are left out.
_FUSED_ATTENTION = ("flash_attention", "efficient_attention", "flash_attention_for_cpu", "cudnn_attention")
ATTENTION_OPS = {
    getattr(torch.ops.aten, f"_scaled_dot_product_{name}").default
    for name in _FUSED_ATTENTION
    if hasattr(torch.ops.aten, f"_scaled_dot_product_{name}")
}
