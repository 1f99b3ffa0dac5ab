"""`model.mlp`: the position-wise feed-forward network, GELU (GPT-2; exact, not its tanh form) or SwiGLU (Llama).

Both keep the input matrix as `fc` and the residual write as `proj`, so per-module names
(`blocks.N.mlp.fc`) mean the same thing in either family. SwiGLU's gate and up projections are one
fused `fc` of twice the width (one matmul instead of two); export splits it into gate_proj/up_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from steadylm.model.config import GPTConfig
from steadylm.model.init import layer


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.fc = layer(nn.Linear, cfg.init, cfg.d_model, (2 if self.swiglu else 1) * cfg.hidden, bias=cfg.bias)
        self.proj = layer(nn.Linear, cfg.init, cfg.hidden, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_proj = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)  # exact (erf), as nanoGPT: on a CPU the tanh form costs 1.7x (3.5 % of a d256 step)
        return self.dropout(self.proj(h))
