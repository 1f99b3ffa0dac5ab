"""`model.norm`: LayerNorm (GPT-2) or RMSNorm (Llama), one constructor for every place a norm sits.

RMSNorm drops LayerNorm's mean subtraction and bias: one reduction instead of two, and Llama-family
checkpoints expect it. Both normalise in fp32 under autocast (torch's kernels upcast internally).
"""

from __future__ import annotations

from torch import nn

from steadylm.model.config import GPTConfig


def make_norm(cfg: GPTConfig, dim: int) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=cfg.norm_eps)
    return nn.LayerNorm(dim, eps=cfg.norm_eps, bias=cfg.bias)
