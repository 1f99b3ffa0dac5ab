"""`model.pos=rope`: rotary position embeddings (RoFormer; GPT-NeoX/Llama "rotate half" layout).

Each pair of q/k channels (i, i + head_dim/2) is rotated by an angle growing with the position, so q·k depends on
the distance between tokens. Hugging Face Llama's layout (exported weights need no permutation); the fp32 cos/sin
tables are non-persistent buffers, rebuilt from the config.
"""

from __future__ import annotations

import torch


def rope_tables(head_dim: int, context_length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, each (context_length, 1, head_dim): Hugging Face Llama's angles, with the sign
    of "rotate half" folded into sin (its first half negated) so applying them is a roll, not a cat."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(context_length, dtype=torch.int64).float(), inv_freq)
    angles = torch.cat((freqs, freqs), dim=-1)
    sin = angles.sin()
    sin[:, : head_dim // 2] *= -1
    return angles.cos().unsqueeze(1), sin.unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, heads, head_dim) by tables (T, 1, head_dim), keeping x's dtype: x·cos + roll(x, half)·sin."""
    return (x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)
