"""The LightningModule: next-token loss, AdamW parameter groups, the per-step LR schedule.

It owns the objective and the optimizer recipe, nothing else: stability checks live in callbacks
(`steadylm.stability`) so each can be switched off and tested alone. It must never cast targets
silently: a float or wrongly shaped target is a data bug, and is refused with a clear message.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.optim.lr_scheduler import LambdaLR

from steadylm.logging_steps import will_log, write_metrics
from steadylm.model import GPT, GPTConfig
from steadylm.schedule import lr_at

IGNORE_INDEX = -100


def _plain(cfg: Any) -> dict:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else dict(cfg)


def check_targets(logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Refuse targets that cross-entropy would accept but mean something else."""
    if targets.dtype != torch.long:
        raise TypeError(
            f"targets must be int64 token ids (torch.long), got {targets.dtype}; "
            "fix the data pipeline instead of casting (a float target is a soft-label bug)"
        )
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} != logits shape {tuple(logits.shape[:-1])}")


class LMModule(L.LightningModule):
    def __init__(
        self, model: dict, optim: dict, compile: bool = False, run_config: dict | None = None, tokenizer: str | None = None
    ):
        super().__init__()
        model, optim = _plain(model), _plain(optim)
        self.save_hyperparameters({"model": model, "optim": optim, "compile": compile})
        self.optim_cfg = optim
        self.z_loss = float(optim.get("z_loss", 0.0))
        self.net = GPT(GPTConfig(**model))
        if compile:
            # In place, so the state_dict keys stay `net.*` (a wrapper attribute would store every weight twice).
            self.net.compile()
        # The resolved run config travels inside every checkpoint so `generate`/`doctor` need nothing else.
        self.run_config = run_config
        self.tokenizer_name = tokenizer
        # Optimizer steps skipped by the stability guard: the LR schedule counts only applied steps.
        self.skipped_steps = 0
        # This step's total grad norm, when the stability probe has already computed it (before clipping).
        self.pre_clip_grad_norm: torch.Tensor | None = None

    def __setattr__(self, name: str, value: Any) -> None:
        # Lightning names the running hook on the module around every hook call: ~46 times a step. nn.Module's
        # __setattr__ first checks whether the value is a parameter, buffer or submodule (~3 µs; ~0.15 ms a
        # step in all); a hook's name never is one.
        if name == "_current_fx_name":
            object.__setattr__(self, name, value)
        else:
            super().__setattr__(name, value)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.net(idx)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean cross-entropy over non-padding tokens, plus z-loss; returns (loss, z_term)."""
        check_targets(logits, targets)
        flat = logits.float().view(-1, logits.shape[-1])
        tgt = targets.view(-1)
        valid = tgt != IGNORE_INDEX
        # sum / count rather than mean: an all-padding batch (end of an epoch on one rank) gives 0, not NaN.
        n = valid.sum().clamp(min=1)
        ce = F.cross_entropy(flat, tgt, ignore_index=IGNORE_INDEX, reduction="sum") / n
        z = flat.new_zeros(())
        if self.z_loss:
            # z-loss (PaLM): keeps log Z near 0 so logits cannot drift to where bf16 softmax loses precision.
            z = self.z_loss * (torch.logsumexp(flat, dim=-1).pow(2) * valid).sum() / n
        return ce + z, z

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss, z = self.loss(self(x), y)
        # Only on the steps the Trainer writes: `self.log` costs ~1-2 ms of Python, a step's worth on small models.
        # As a host copy: Lightning turns the progress-bar value into a number after EVERY step, and on a
        # device tensor that `.item()` would be one more host sync per step (35 conversions in 40 steps).
        if will_log(self.trainer):
            self.log("train/loss", loss.detach().cpu(), on_step=True, prog_bar=True)
            if self.z_loss:
                self.log("train/z_loss", z, on_step=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss, _ = self.loss(self(x), y)
        self.log("val/loss", loss, on_epoch=True, sync_dist=True, prog_bar=True)

    def on_train_batch_start(self, batch, batch_idx):
        if will_log(self.trainer):
            write_metrics(self.trainer, {"optim/lr": self.lr_schedulers().get_last_lr()[0]})

    def configure_optimizers(self):
        o = self.optim_cfg
        # Weight decay only on matrices (linears, embeddings); decaying gains and biases hurts.
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": o["weight_decay"]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        # Fused: one kernel for all tensors (on CPU too: ~5x faster than the per-tensor loop, the CPU default).
        # fp16's GradScaler must unscale before clipping, which fused AdamW does not allow.
        fp16 = self._trainer is not None and self._trainer.precision == "16-mixed"  # no Trainer: a plain loop
        fused = self.device.type in ("cuda", "cpu") and not fp16
        opt = torch.optim.AdamW(groups, lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], fused=fused)
        sched = LambdaLR(opt, lambda step: self.lr_factor(step - self.skipped_steps))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Norm clipping with the probe's pre-clip norm: the same result, one pass over the gradients fewer."""
        norm, self.pre_clip_grad_norm = self.pre_clip_grad_norm, None
        if norm is None or not gradient_clip_val or gradient_clip_algorithm != "norm":
            return super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        torch.nn.utils.clip_grads_with_norm_(params, gradient_clip_val, norm)

    def lr_factor(self, step: int) -> float:
        o = self.optim_cfg
        lr = lr_at(step, lr=o["lr"], min_lr=o["min_lr"], warmup_steps=o["warmup_steps"], total_steps=o["total_steps"])
        return lr / o["lr"]

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["steadylm"] = {
            "config": self.run_config, "tokenizer": self.tokenizer_name, "skipped_steps": self.skipped_steps,
        }

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.skipped_steps = int(checkpoint.get("steadylm", {}).get("skipped_steps", 0))
