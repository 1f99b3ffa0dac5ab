"""A decoder-only transformer, GPT-2 or Llama shaped by `GPTConfig`'s switches, readable top to bottom.

Pre-norm blocks (`x + attn(norm(x))`, `x + mlp(norm(x))`); positions learned (`wpe`, GPT-2) or rotary
(`model.pos=rope`, inside attention). Module names are the same in both families (`wte`, `blocks.N.attn.qkv`,
`blocks.N.mlp.fc`, `ln_f`, `lm_head`), so the stability callbacks, fault injectors and export read either one.
No training logic here: no optimizer, no logging, no loss scaling.
"""

from __future__ import annotations

import torch
from torch import nn

from steadylm.model import mup
from steadylm.model.attention import CausalSelfAttention
from steadylm.model.config import GPTConfig
from steadylm.model.init import init_weights, layer
from steadylm.model.mlp import MLP
from steadylm.model.norm import make_norm
from steadylm.model.rope import rope_tables
from steadylm.model.switches import require_understood

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP"]


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
        if cfg.pos == "learned":
            self.wpe = layer(nn.Embedding, cfg.init, cfg.context_length, cfg.d_model)
        else:
            self.wpe = None
            cos, sin = rope_tables(cfg.head_dim, cfg.context_length, cfg.rope_theta)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg, cfg.d_model)
        self.lm_head = layer(nn.Linear, cfg.init, cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            # Weight tying: the input and output embeddings share one matrix (fewer params, better small LMs).
            self.lm_head.weight = self.wte.weight
        init_weights(self, cfg.init, cfg.n_layer, hidden_std_mult=mup.hidden_init_mult(cfg))
        # muP's readout factor 1/width_mult (1 under sp), on the final hidden state: d_model floats, not vocab.
        self.logit_mult = mup.logit_mult(cfg)
        # The residual stream's RMS after the last block, kept when `track_residual` (the precursor signals' input).
        self.track_residual = False
        self.residual_rms: torch.Tensor | None = None

    def forward(self, idx: torch.Tensor, head: bool = True) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab_size); `head=False`: the head's input (B, T, d_model) instead,
        for a loss that applies `lm_head.weight` itself a chunk of tokens at a time (`steadylm.head_loss`)."""
        T = idx.shape[1]
        if T > self.cfg.context_length:
            raise ValueError(f"sequence length {T} > model.context_length={self.cfg.context_length}")
        x = self.wte(idx)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        else:
            rope = (self.rope_cos[:T], self.rope_sin[:T])
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, rope)
        if self.track_residual:
            self.residual_rms = x.detach().float().pow(2).mean().sqrt()
        x = self.ln_f(x)
        if self.logit_mult != 1.0:
            x = x * self.logit_mult
        return self.lm_head(x) if head else x

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count (a tied matrix once). `non_embedding` drops the tables that are only looked up,
        never multiplied: the position table, and the token table when the output head is separate (6N rule)."""
        n = sum(p.numel() for p in self.parameters())
        if not non_embedding:
            return n
        if self.wpe is not None:
            n -= self.wpe.weight.numel()
        if not self.cfg.tie_embeddings:
            n -= self.wte.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for the matmuls plus 12·L·d·T for attention (PaLM appendix B); grouped k/v
        heads save memory and weights, not score FLOPs."""
        c = self.cfg
        require_understood(c, "flops")  # a switch this formula does not know (e.g. a windowed pattern) is refused
        return 6 * self.num_params() + 12 * c.n_layer * c.d_model * c.context_length
