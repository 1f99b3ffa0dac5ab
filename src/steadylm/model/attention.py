"""Causal self-attention with optional grouped-query heads (n_kv_head < n_head), rotary positions and QK-norm.
Which keys a query may see is defined once, by `blocked` (a new pattern is a `pattern` value taught to it), which
the kernel call and the max-logit measurement both follow. Rotary: Hugging Face Llama's "rotate half" layout."""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable

import torch
import torch.nn.functional as F
from torch import nn

from steadylm.model import mup
from steadylm.model.config import GPTConfig
from steadylm.model.init import layer, make_norm


def rope_tables(head_dim: int, context_length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (context_length, 1, head_dim), fp32; sin's first half negated: applying them is a roll."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    angles = torch.outer(torch.arange(context_length, dtype=torch.int64).float(), inv_freq).repeat(1, 2)
    sin = angles.sin()
    sin[:, : head_dim // 2] *= -1
    return angles.cos().unsqueeze(1), sin.unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, heads, head_dim) by tables (T, 1, head_dim), keeping x's dtype: x·cos + roll(x, half)·sin."""
    return (x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)


@functools.lru_cache(maxsize=16)
def _additive(blocked, pattern: Hashable, rows: int, cols: int, start: int, device: torch.device) -> torch.Tensor:
    """`blocked` as -inf/0 for `baddbmm`, which saves a pass over the logits; built once per pattern and shape."""
    hidden = blocked(pattern, rows, cols, start, device)
    return torch.zeros(rows, cols, device=device).masked_fill_(hidden, float("-inf"))


class CausalSelfAttention(nn.Module):
    pattern: Hashable = "causal"

    @staticmethod
    def blocked(pattern: Hashable, rows: int, cols: int, start: int, device: torch.device) -> torch.Tensor:
        """(rows, cols) bools, True where query `start + i` must not see key `j`. Every pattern hides at least the
        future (a decoder predicts left to right), which the measurement relies on."""
        if pattern != "causal":
            raise ValueError(f"attention pattern {pattern!r} is not known to CausalSelfAttention.blocked")
        return torch.ones(rows, cols, dtype=torch.bool, device=device).triu(start + 1)

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        qkv = (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim
        self.qkv = layer(nn.Linear, cfg.init, cfg.d_model, qkv, bias=cfg.bias)
        self.proj = layer(nn.Linear, cfg.init, cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_proj = True
        self.q_norm = make_norm(cfg, self.head_dim) if cfg.qk_norm else nn.Identity()
        self.k_norm = make_norm(cfg, self.head_dim) if cfg.qk_norm else nn.Identity()
        self.dropout = cfg.dropout
        self.scale = mup.attn_scale(cfg)  # None: SDPA's 1/sqrt(head_dim)
        self.track_max_logit = False  # set by the stability callback on its measuring steps: QK^T costs O(T^2)
        self.max_logit: torch.Tensor | None = None  # the layer's largest logit (a scalar)
        self.head_max_logit: torch.Tensor | None = None  # each query head's largest logit, (n_head,)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x (B, T, C); `rope`: this length's (cos, sin) tables, each (T, 1, head_dim), or None."""
        (B, T, C), H, KV, D = x.shape, self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.qkv(x).view(B, T, H + 2 * KV, D).split([H, KV, KV], dim=2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # in (B, T, heads, D), before the transpose: elementwise ops on contiguous rows
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        # enable_gqa reads each k/v head once per group (no copies); CUDA's fp32 (memory-efficient) kernel lacks it
        # and would fall back to the O(T^2) math path, so the heads are repeated there.
        repeat = KV != H and x.is_cuda and v.dtype == torch.float32
        if repeat:
            k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        gqa = {"enable_gqa": True} if KV != H and not repeat else {}
        if self.track_max_logit:
            kk = k if k.shape[1] == H else k.repeat_interleave(H // KV, dim=1)
            self.head_max_logit = self._max_causal_logit(q.detach(), kk.detach())
            self.max_logit = self.head_max_logit.amax()
        # `is_causal` is `blocked("causal")` in the kernels (no mask in memory; a test holds the two equal).
        mask = {"is_causal": True}
        if self.pattern != "causal":
            mask = {"attn_mask": ~self.blocked(self.pattern, T, T, 0, x.device)}
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=self.scale, **mask, **gqa)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def _max_causal_logit(self, q: torch.Tensor, k: torch.Tensor, rows: int = 256) -> torch.Tensor:
        """Each head's largest visible pre-softmax logit (n_head,), on the batch's first sequence, `rows` at a time."""
        q, k, T, best = q[0].float(), k[0].float(), q.shape[-2], []
        for start in range(0, T, rows):
            stop = min(start + rows, T)
            hidden = _additive(type(self).blocked, self.pattern, stop - start, stop, start, q.device)
            best.append(torch.baddbmm(hidden, q[:, start:stop], k[:, :stop].mT).amax(dim=(-2, -1)))
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)
        return torch.stack(best).amax(0) * scale  # scale > 0: the max of the scaled logits, without scaling each
