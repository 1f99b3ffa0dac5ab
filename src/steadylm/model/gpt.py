"""A decoder-only transformer (GPT-2 shape), readable top to bottom.

Pre-LayerNorm blocks, causal attention through `F.scaled_dot_product_attention(is_causal=True)`
(the flash/memory-efficient kernels where available, and a mask that cannot leak the future by
construction), a GELU MLP, learned position embeddings and tied input/output embeddings.
This module must stay free of training logic: no optimizer, no logging, no loss scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from steadylm.model.init import init_weights


@dataclass
class GPTConfig:
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    context_length: int = 128
    vocab_size: int = 320
    dropout: float = 0.0
    bias: bool = True
    qk_norm: bool = False  # LayerNorm on queries and keys: bounds attention logits at high LR
    init: str = "gpt2"  # gpt2 | xavier | torch_default

    def __post_init__(self) -> None:
        if self.d_model % self.n_head:
            raise ValueError(f"model.d_model={self.d_model} must be divisible by model.n_head={self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.head_dim = cfg.d_model // cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_proj = True
        self.q_norm = nn.LayerNorm(self.head_dim) if cfg.qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if cfg.qk_norm else nn.Identity()
        self.dropout = cfg.dropout
        # Set by the stats callback on logging steps only: the explicit QK^T it needs costs O(T^2).
        self.track_max_logit = False
        self.max_logit: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.track_max_logit:
            self.max_logit = self._max_causal_logit(q.detach(), k.detach())
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def _max_causal_logit(self, q: torch.Tensor, k: torch.Tensor, rows: int = 256) -> torch.Tensor:
        """Largest pre-softmax logit a query gives a visible key: its growth precedes attention collapse.

        Taken on the batch's first sequence, `rows` queries at a time: logit growth is a property of
        the weights, so one sequence shows it, and the explicit QK^T stays at heads x rows x T floats
        (a whole batch at T=2048 would be gigabytes on the logging step).
        """
        q, k = q[0].float(), k[0].float()
        T = q.shape[-2]
        best = q.new_full((), float("-inf"))
        for start in range(0, T, rows):
            stop = min(start + rows, T)
            logits = (q[:, start:stop] @ k[:, :stop].transpose(-2, -1)) / math.sqrt(self.head_dim)
            future = torch.ones(stop - start, stop, dtype=torch.bool, device=q.device).triu(start + 1)
            best = torch.maximum(best, logits.masked_fill(future, float("-inf")).amax())
        return best


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_proj = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.context_length, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # Weight tying: the input and output embeddings share one matrix (fewer params, better LM).
        self.lm_head.weight = self.wte.weight
        init_weights(self, cfg.init, cfg.n_layer)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab_size)."""
        T = idx.shape[1]
        if T > self.cfg.context_length:
            raise ValueError(f"sequence length {T} > model.context_length={self.cfg.context_length}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; position embeddings excluded by default, as in the 6N FLOP rule."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for the matmuls plus 12·L·d·T for attention (PaLM appendix B)."""
        c = self.cfg
        return 6 * self.num_params() + 12 * c.n_layer * c.d_model * c.context_length
