"""`model.pos=rope`: rotary position embeddings (RoFormer; GPT-NeoX/Llama "rotate half" layout).

Each pair of query/key channels (i, i + head_dim/2) is rotated by an angle that grows with the position,
so q·k depends on the distance between two tokens rather than on where they sit. The layout matches
Hugging Face's Llama, so exported q/k weights need no permutation. The cos/sin tables are computed in
fp32 once per model and kept as non-persistent buffers: never in a checkpoint, rebuilt from the config.
"""

from __future__ import annotations

import torch


def rope_tables(head_dim: int, context_length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (context_length, head_dim), computed as Hugging Face's Llama computes them."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(context_length, dtype=torch.int64).float(), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, heads, T, head_dim) by the tables' first T rows; the result keeps x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)
