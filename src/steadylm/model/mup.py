"""`model.parametrization=mup`: the multipliers that make the best LR found at a base width hold at any width.

muP (Tensor Programs V; microsoft/mup's MuAdamW; the rules in docs/model.md), m = d_model / mup_base_width. Adam
moves each weight by ~lr whatever the width and a hidden matrix sums fan_in such moves, hence its LR / m; the
readout and the attention scores sum coordinates training makes correlated, hence 1/m and 1/d_head. At the base
shape every multiplier is exactly 1: mup is sp bit for bit. The Muon groups keep `optim.lr` (lr_transfer.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from steadylm.model.config import GPTConfig


def width_mult(cfg: GPTConfig) -> float:
    return cfg.d_model / cfg.mup_base_width if cfg.parametrization == "mup" else 1.0


def logit_mult(cfg: GPTConfig) -> float:
    return cfg.mup_output_mult / width_mult(cfg) if cfg.parametrization == "mup" else 1.0


def attn_scale(cfg: GPTConfig) -> float | None:
    """None under sp (SDPA's 1/sqrt(d_head)); mup: 1/sqrt(b) * (b/d_head), the same float as sp's at d_head = b."""
    b = cfg.mup_base_head_dim
    return (1.0 / math.sqrt(b)) * (b / cfg.head_dim) if cfg.parametrization == "mup" else None


def param_groups(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: GPTConfig, lr: float, weight_decay: float
) -> list[dict]:
    """AdamW groups, decay on >=2-D weights: sp [matrices, vectors]; mup [embedding-like, vectors, hidden at lr/m,
    wd*m]. Group 0 runs at the base LR (`optim/lr`)."""
    params = [(n, p) for n, p in named_params if p.requires_grad]
    matrices = [(n, p) for n, p in params if p.dim() >= 2]
    vectors = ("vectors", [p for _, p in params if p.dim() < 2], 0.0, 1.0)
    if cfg.parametrization != "mup":
        groups = [("matrices", [p for _, p in matrices], weight_decay, 1.0), vectors]
    else:  # embedding-like: one side is the vocabulary or the positions, so no width factor
        m, tables = width_mult(cfg), ("wte.weight", "wpe.weight", "lm_head.weight")
        groups = [
            ("embeddings", [p for n, p in matrices if n.endswith(tables)], weight_decay, 1.0),
            vectors,
            ("hidden", [p for n, p in matrices if not n.endswith(tables)], weight_decay * m, 1.0 / m),
        ]
    return [{"name": g, "params": ps, "weight_decay": wd, "lr_mult": k, "lr": lr * k} for g, ps, wd, k in groups]
