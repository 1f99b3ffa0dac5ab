"""A decoder-only transformer, GPT-2 or Llama shaped by `GPTConfig`'s switches: pre-norm blocks, positions learned
(`wpe`) or rotary (inside attention). Module names are the same in both families (`wte`, `blocks.N.attn.qkv`,
`blocks.N.mlp.fc`, `ln_f`, `lm_head`), so the stability callbacks, fault injectors and export read either one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from steadylm.model import mup
from steadylm.model.attention import CausalSelfAttention, rope_tables
from steadylm.model.config import GPTConfig
from steadylm.model.init import init_weights, layer, make_norm
from steadylm.model.switches import require_understood


class MLP(nn.Module):
    """GELU (GPT-2) or SwiGLU (Llama), whose gate and up projections are one `fc` (export splits it)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.fc = layer(nn.Linear, cfg.init, cfg.d_model, (2 if self.swiglu else 1) * cfg.hidden, bias=cfg.bias)
        self.proj = layer(nn.Linear, cfg.init, cfg.hidden, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_proj = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.fc(x).chunk(2, dim=-1)
            return self.dropout(self.proj(F.silu(gate) * up))
        return self.dropout(self.proj(F.gelu(self.fc(x))))  # exact (erf): on a CPU the tanh form costs 1.7x


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(cfg, cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = make_norm(cfg, cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = layer(nn.Embedding, cfg.init, cfg.vocab_size, cfg.d_model)
        self.wpe = layer(nn.Embedding, cfg.init, cfg.context_length, cfg.d_model) if cfg.pos == "learned" else None
        if self.wpe is None:
            cos, sin = rope_tables(cfg.head_dim, cfg.context_length, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg, cfg.d_model)
        self.lm_head = layer(nn.Linear, cfg.init, cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        init_weights(self, cfg)
        self.logit_mult = mup.logit_mult(cfg)  # on the final hidden state: d_model floats, not vocab
        self.track_residual = False  # keep the residual stream's RMS after the last block (the precursor signals')
        self.residual_rms: torch.Tensor | None = None

    def forward(self, idx: torch.Tensor, head: bool = True) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab_size), or with `head=False` the head's input (`head_loss`)."""
        T = idx.shape[1]
        if T > self.cfg.context_length:
            raise ValueError(f"sequence length {T} > model.context_length={self.cfg.context_length}")
        rope = None if self.wpe is not None else (self.rope_cos[:T], self.rope_sin[:T])
        x = self.drop(self.wte(idx) if rope else self.wte(idx) + self.wpe(torch.arange(T, device=idx.device)))
        for block in self.blocks:
            x = block(x, rope)
        if self.track_residual:
            self.residual_rms = x.detach().float().pow(2).mean().sqrt()
        x = self.ln_f(x)
        if self.logit_mult != 1.0:
            x = x * self.logit_mult
        return self.lm_head(x) if head else x

    def num_params(self, non_embedding: bool = True) -> int:
        """A tied matrix once; `non_embedding` drops the tables only looked up, never multiplied (the 6N rule)."""
        tables = [self.wpe, None if self.cfg.tie_embeddings else self.wte] if non_embedding else []
        return sum(p.numel() for p in self.parameters()) - sum(t.weight.numel() for t in tables if t is not None)

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for the matmuls plus 12·L·d·T for the scores (PaLM appendix B)."""
        require_understood(self.cfg, "flops")
        return 6 * self.num_params() + 12 * self.cfg.n_layer * self.cfg.d_model * self.cfg.context_length
