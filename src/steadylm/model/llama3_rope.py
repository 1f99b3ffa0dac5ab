"""Llama 3's rotary scaling (`model.rope_scaling`): its check and its frequencies, as transformers computes them.
Loaded only by a model that sets it (a published Llama 3, `model.init_from`)."""

from __future__ import annotations

import math

import torch

from steadylm.errors import ConfigError, number

LLAMA3_ROPE = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(scaling, pos: str) -> None:
    """`model.rope_scaling`: null, or Llama 3's rescaled rotary frequencies (`rope_type: llama3` and its four numbers,
    as its config.json writes them; `gpt.rope_tables` applies them)."""
    example = "{rope_type: llama3, factor: 32, low_freq_factor: 1, high_freq_factor: 4, original_max_position_embeddings: 8192}"
    if pos != "rope":
        raise ConfigError(f"model.rope_scaling is set but model.pos={pos}: rotary scaling needs model.pos=rope")
    if not isinstance(scaling, dict) or scaling.get("rope_type") != "llama3":
        raise ConfigError(f"model.rope_scaling={scaling!r} is not allowed; it must be null or Llama 3's {example}")
    if unknown := sorted(set(scaling) - {"rope_type", *LLAMA3_ROPE}):
        raise ConfigError(f"model.rope_scaling.{unknown[0]} is not a llama3 rope key; it has {', '.join(LLAMA3_ROPE)}")
    for key in LLAMA3_ROPE:
        if not number(scaling.get(key)) > 0:
            raise ConfigError(f"model.rope_scaling.{key}={scaling.get(key)!r} must be a number > 0 ({example})")
    if not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ConfigError(
            f"model.rope_scaling.high_freq_factor={scaling['high_freq_factor']} must exceed low_freq_factor="
            f"{scaling['low_freq_factor']} (Llama 3: 4 and 1)"
        )


def llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3's rotary frequencies (`model.rope_scaling`): wavelengths longer than the original context / low_freq_factor
    slowed by `factor`, shorter than it / high_freq_factor kept, those between blended linearly (as transformers)."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    between = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(between, (1 - smooth) * slowed / factor + smooth * slowed, slowed)
