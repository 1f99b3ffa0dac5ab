"""How the model's layers are built and initialised. `model.init=gpt2`: N(0, 0.02), the residual projections by
1/sqrt(2·n_layer) so the residual variance does not grow with depth (GPT-2 §2.3); `xavier`: Glorot-uniform
linears; `torch_default`: PyTorch's own, kept to show what unstable init looks like."""

from __future__ import annotations

import math

import torch
from torch import nn

from steadylm.model import mup
from steadylm.model.config import GPTConfig


def layer(cls: type[nn.Module], init: str, *args, **kwargs) -> nn.Module:
    """`cls(*args, **kwargs)`, built on the meta device when `init_weights` overwrites PyTorch's default init (most of
    building a big model on a CPU)."""
    if init == "torch_default":
        return cls(*args, **kwargs)
    return cls(*args, device="meta", **kwargs).to_empty(device=torch.get_default_device())


def make_norm(cfg: GPTConfig, dim: int) -> nn.Module:
    return nn.RMSNorm(dim, cfg.norm_eps) if cfg.norm == "rmsnorm" else nn.LayerNorm(dim, cfg.norm_eps, bias=cfg.bias)


def init_weights(model: nn.Module, cfg: GPTConfig) -> None:
    """gpt2: every linear but the readout (`lm_head`) gets its std times muP's 1/sqrt(m)."""
    if cfg.init == "torch_default":
        return
    mult = 1.0 / math.sqrt(mup.width_mult(cfg))
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if cfg.init == "gpt2":
                std = 0.02 / math.sqrt(2 * cfg.n_layer) if getattr(module, "is_residual_proj", False) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std if module is model.lm_head else std * mult)
            else:
                nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
