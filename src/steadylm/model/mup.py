"""`model.parametrization=mup`: the multipliers that make the best LR found at a base width hold at any width.

muP (Tensor Programs V; the Cerebras/EleutherAI practitioner's guide, nanoGPT-mup) makes every
coordinate's size, and every update's effect on it, independent of width, so a sweep on the base shape
picks an LR that is also right 8x wider. With width multiplier m = d_model / mup_base_width:

| what | sp | mup | where it acts |
| --- | --- | --- | --- |
| hidden matrices (qkv, attn.proj, mlp.fc, mlp.proj): init std | 0.02 | 0.02 / sqrt(m) | `init.init_weights` |
| hidden matrices: Adam LR | lr | lr / m (`lr_mult`) | `param_groups` |
| hidden matrices: weight decay | wd | wd * m (so lr * wd, the per-step shrink, is width-free) | `param_groups` |
| embeddings wte/wpe, an untied lm_head, norm gains, biases | lr, N(0, 0.02) | the same | - |
| logits | lm_head(ln_f(x)) | lm_head(ln_f(x) * alpha / m), alpha = mup_output_mult (1) | `GPT.forward` |
| attention scores | q.k / sqrt(d_head) | q.k * sqrt(b) / d_head, b = mup_base_head_dim | `CausalSelfAttention` |

At the base shape (m = 1, d_head = b, alpha = 1) every multiplier is exactly 1, so mup there is sp bit for bit:
the LR a user already tuned in sp at the base is the mup LR. Adam normalises gradients, so an update
changes each weight by ~lr whatever the width; a hidden matrix sums fan_in such changes into each output,
hence its LR falls as 1/m. Embedding tables and the readout have one finite side (vocab, positions), so
their LR stays. The readout sums d_model coordinates that training makes correlated with its weights,
hence the 1/m on the logits; attention scores do the same over d_head, hence 1/d_head instead of
1/sqrt(d_head). Torch's AdamW decays by lr * wd per step, so the 1/m on the LR alone would weaken the
hidden decay at width; scaling wd by m keeps it (microsoft/mup's MuAdamW rule for AdamW).

Under `optim=muon` these groups are AdamW's (embeddings, vectors); the Muon groups keep `optim.lr` with no
width factor. Muon's `match_rms_adamw` step already sets each matrix's update size from its shape, and measured
(`benchmarks/lr_transfer.py --optim muon --widths 32,256`) its best LR moved -0.5 octaves from 1x to 8x with
no factor, +1.0 with width_mult^-0.5 (the spectral rule), so none is applied.

This module must stay free of optimizer objects and training state: it returns numbers and param groups.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from steadylm.model.config import GPTConfig

# Tables that are looked up (or, tied or not, the readout): one side is the vocabulary or the positions.
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
    """The attention score scale; None = SDPA's own 1/sqrt(d_head) (sp).

    mup: sqrt(b)/d_head, i.e. 1/d_head with the constant chosen so the base head size b gets sp's
    1/sqrt(b) exactly (written as 1/sqrt(b) * (b/d_head) so that case is the same float).
    """
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
    """AdamW param groups, each with `lr_mult` and the initial `lr = lr * lr_mult`.

    Weight decay only on >=2-D weights (decaying gains and biases hurts). sp: [matrices, vectors], both
    at lr. mup: [embedding-like, vectors, hidden], the hidden group at lr/m and wd*m. The first group
    always runs at the base LR, so `optim/lr` (group 0) is the LR a user set.
    """
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


def sp_state_dict(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of an sp model (1/sqrt(d_head) attention, no logit factor) computing the same function.

    What export writes, since Hugging Face's GPT-2 and Llama have neither multiplier. The logit factor
    goes into the final norm's gain and bias (ln_f is linear in them; the tied embedding cannot carry it
    without changing the input). The attention factor c = sqrt(b / d_head) goes into the queries: the q
    rows of `qkv` (rotary positions are linear, so they commute), or the q_norm gain when QK-norm would
    undo a scaled projection. Under sp (or mup at the base shape) it is `net.state_dict()` unchanged.
    """
    cfg = net.cfg
    sd = dict(net.state_dict())
    scale, mult = attn_scale(cfg), logit_mult(cfg)
    if mult != 1.0:
        for key in ("ln_f.weight", "ln_f.bias"):
            if key in sd:
                sd[key] = sd[key] * mult
    if scale is None or scale == 1.0 / math.sqrt(cfg.head_dim):
        return sd
    c = scale * math.sqrt(cfg.head_dim)
    q_rows = cfg.n_head * cfg.head_dim
    for i in range(cfg.n_layer):
        p = f"blocks.{i}.attn."
        keys = (p + "q_norm.weight", p + "q_norm.bias") if cfg.qk_norm else (p + "qkv.weight", p + "qkv.bias")
        for key in keys:
            if key not in sd:
                continue
            t = sd[key].clone()
            if cfg.qk_norm:
                t *= c
            else:
                t[:q_rows] *= c
            sd[key] = t
    return sd
