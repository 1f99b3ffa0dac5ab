"""Weight initialisation schemes, selected by `model.init`.

`gpt2` (default): N(0, 0.02) everywhere, and the projections that write into the residual stream
scaled by 1/sqrt(2·n_layer) so the residual variance does not grow with depth (GPT-2 paper §2.3).
`xavier`: Glorot-uniform linears, what older guides suggest for deep stacks.
`torch_default`: PyTorch's own per-layer defaults, kept to show what unstable init looks like.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from steadylm.errors import ConfigError
from steadylm.model.config import INITS as INIT_SCHEMES


def layer(cls: type[nn.Module], init: str, *args, **kwargs) -> nn.Module:
    """`cls(*args, **kwargs)` without PyTorch's default init when `init_weights` overwrites it anyway (that draw
    was most of building a big model on a CPU): built on the meta device, then given memory on the default one."""
    if init == "torch_default":
        return cls(*args, **kwargs)
    return cls(*args, device="meta", **kwargs).to_empty(device=torch.get_default_device())


def init_weights(model: nn.Module, scheme: str, n_layer: int, hidden_std_mult: float = 1.0) -> None:
    """`hidden_std_mult` (gpt2 only) scales every linear but the readout: muP's 1/sqrt(width_mult)."""
    if scheme not in INIT_SCHEMES:
        raise ConfigError(f"model.init={scheme!r} is not allowed; use one of: {', '.join(INIT_SCHEMES)}")
    if scheme == "torch_default":
        return
    readout = getattr(model, "lm_head", None)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            if scheme == "gpt2":
                std = 0.02 / math.sqrt(2 * n_layer) if getattr(module, "is_residual_proj", False) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std if module is readout else std * hidden_std_mult)
            else:
                nn.init.xavier_uniform_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
