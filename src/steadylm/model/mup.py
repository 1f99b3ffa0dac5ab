"""`model.parametrization=mup`: the multipliers that make the best LR found at a base width hold at any width.

muP (Tensor Programs V; microsoft/mup's MuAdamW rule), width multiplier m = d_model / mup_base_width:

| what | sp | mup | where |
| --- | --- | --- | --- |
| hidden matrices (qkv, attn.proj, mlp.fc, mlp.proj): init std | 0.02 | 0.02 / sqrt(m) | `init.init_weights` |
| hidden matrices: Adam LR, weight decay | lr, wd | lr / m, wd * m (lr * wd stays width-free) | `param_groups` |
| embeddings wte/wpe, an untied lm_head, norm gains, biases | lr, N(0, 0.02) | the same | - |
| logits | lm_head(ln_f(x)) | lm_head(ln_f(x) * alpha / m), alpha = mup_output_mult | `GPT.forward` |
| attention scores | q.k / sqrt(d_head) | q.k * sqrt(b) / d_head, b = mup_base_head_dim | `CausalSelfAttention` |

At the base shape every multiplier is exactly 1, so mup there is sp bit for bit. Adam moves each weight by ~lr
whatever the width and a hidden matrix sums fan_in such moves, hence lr / m; the readout and attention scores sum
coordinates training makes correlated, hence 1/m and 1/d_head. Under `optim=muon` these are AdamW's groups; the
Muon groups keep `optim.lr` (measured with `benchmarks/lr_transfer.py --optim muon`: no width factor is best).
Numbers and param groups only; export folds the multipliers into the weights (`export.sp_state_dict`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from steadylm.model.config import GPTConfig

# One side is the vocabulary or the positions: no width factor.
EMBEDDING_LIKE = ("wte.weight", "wpe.weight", "lm_head.weight")


def width_mult(cfg: GPTConfig) -> float:
    """m = d_model / mup_base_width under mup; 1 under sp."""
    return cfg.d_model / cfg.mup_base_width if cfg.parametrization == "mup" else 1.0


def hidden_init_mult(cfg: GPTConfig) -> float:
    """Factor on the gpt2 init std of hidden matrices: their variance falls as 1/m (as 1/fan_in)."""
    return 1.0 / math.sqrt(width_mult(cfg))


def logit_mult(cfg: GPTConfig) -> float:
    """Factor on the final hidden state before the readout: alpha_output / m (1 under sp)."""
    if cfg.parametrization != "mup":
        return 1.0
    return cfg.mup_output_mult / width_mult(cfg)


def attn_scale(cfg: GPTConfig) -> float | None:
    """None under sp (SDPA's 1/sqrt(d_head)); mup: 1/sqrt(b) * (b/d_head), the same float as sp's at d_head = b."""
    if cfg.parametrization != "mup":
        return None
    b = cfg.mup_base_head_dim
    return (1.0 / math.sqrt(b)) * (b / cfg.head_dim)


def is_hidden(name: str, p: torch.Tensor) -> bool:
    """A matrix with both sides growing with width (every >=2-D weight but the embedding-like tables)."""
    return p.dim() >= 2 and not name.endswith(EMBEDDING_LIKE)


def param_groups(
    named_params: Iterable[tuple[str, torch.nn.Parameter]], cfg: GPTConfig, lr: float, weight_decay: float
) -> list[dict]:
    """AdamW groups with `lr_mult` and `lr = lr * lr_mult`, decay only on >=2-D weights. sp: [matrices, vectors];
    mup: [embedding-like, vectors, hidden at lr/m, wd*m]. Group 0 runs at the base LR (`optim/lr`)."""
    params = [(n, p) for n, p in named_params if p.requires_grad]
    vectors = [p for _, p in params if p.dim() < 2]
    if cfg.parametrization != "mup":
        groups = [
            ("matrices", [p for _, p in params if p.dim() >= 2], weight_decay, 1.0),
            ("vectors", vectors, 0.0, 1.0),
        ]
    else:
        m = width_mult(cfg)
        groups = [
            ("embeddings", [p for n, p in params if p.dim() >= 2 and not is_hidden(n, p)], weight_decay, 1.0),
            ("vectors", vectors, 0.0, 1.0),
            ("hidden", [p for n, p in params if is_hidden(n, p)], weight_decay * m, 1.0 / m),
        ]
    return [
        {"name": name, "params": ps, "weight_decay": wd, "lr_mult": mult, "lr": lr * mult}
        for name, ps, wd, mult in groups
    ]
