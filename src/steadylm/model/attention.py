"""Causal self-attention with optional grouped-query heads, rotary positions and QK-norm.

One fused `qkv` projection makes n_head query heads and n_kv_head key/value heads (fewer: grouped-query
attention). Attention is `F.scaled_dot_product_attention(is_causal=True)`; which keys a query may see is defined
once, by `CausalSelfAttention.blocked`, which the kernel call and the max-logit measurement both follow.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Hashable

import torch
import torch.nn.functional as F
from torch import nn

from steadylm.model import mup
from steadylm.model.config import GPTConfig
from steadylm.model.init import layer
from steadylm.model.norm import make_norm
from steadylm.model.rope import apply_rope


@functools.lru_cache(maxsize=16)
def _additive(
    blocked: Callable, pattern: Hashable, rows: int, cols: int, start: int, device: torch.device
) -> torch.Tensor:
    """`blocked` as -inf (hidden) and 0 (visible), added inside the product (`baddbmm`), which saves a pass over the
    logits (0.46 against 0.79 ms a layer at T 256 on a CPU); built once per pattern and shape, shared by the layers."""
    return torch.zeros(rows, cols, device=device).masked_fill_(
        blocked(pattern, rows, cols, start, device), float("-inf")
    )


class CausalSelfAttention(nn.Module):
    # Which keys a query may see: `blocked` is the one definition, `pattern` the value it reads; a new pattern is a
    # new `pattern` value taught to `blocked` (in a subclass, or here), nothing else.
    pattern: Hashable = "causal"

    @staticmethod
    def blocked(pattern: Hashable, rows: int, cols: int, start: int, device: torch.device) -> torch.Tensor:
        """(rows, cols) bools, True where query `start + i` must not see key `j`: `causal` hides the future. Every
        pattern hides at least the future (a decoder predicts left to right), which the measurement relies on."""
        if pattern != "causal":
            raise ValueError(f"attention pattern {pattern!r} is not known to CausalSelfAttention.blocked")
        return torch.ones(rows, cols, dtype=torch.bool, device=device).triu(start + 1)

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.qkv = layer(
            nn.Linear, cfg.init, cfg.d_model, (cfg.n_head + 2 * cfg.n_kv_head) * cfg.head_dim, bias=cfg.bias
        )
        self.proj = layer(nn.Linear, cfg.init, cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_proj = True
        self.q_norm = make_norm(cfg, self.head_dim) if cfg.qk_norm else nn.Identity()
        self.k_norm = make_norm(cfg, self.head_dim) if cfg.qk_norm else nn.Identity()
        self.dropout = cfg.dropout
        # None: SDPA's 1/sqrt(head_dim) (sp); muP's 1/head_dim scaling otherwise (model/mup.py).
        self.scale = mup.attn_scale(cfg)
        # Set by the stability callback on its measuring steps only: the explicit QK^T costs O(T^2).
        self.track_max_logit = False
        self.max_logit: torch.Tensor | None = None  # the layer's largest logit (a scalar)
        self.head_max_logit: torch.Tensor | None = None  # each query head's largest logit, (n_head,)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """x (B, T, C); `rope`: this length's (cos, sin) tables, each (T, 1, head_dim), or None."""
        B, T, C = x.shape
        H, KV, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.qkv(x).view(B, T, H + 2 * KV, D).split([H, KV, KV], dim=2)
        q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:  # in (B, T, heads, D), before the transpose: elementwise ops on contiguous rows
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, D)
        gqa = {}
        if KV != H:
            # enable_gqa reads each k/v head once per group (no copies); CUDA's fp32 (memory-efficient) kernel lacks
            # it and would fall back to the O(T^2) math path, so the heads are repeated there.
            if x.is_cuda and v.dtype == torch.float32:
                k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
            else:
                gqa = {"enable_gqa": True}
        if self.track_max_logit:
            kk = k if k.shape[1] == H else k.repeat_interleave(H // KV, dim=1)
            self.head_max_logit = self._max_causal_logit(q.detach(), kk.detach())
            self.max_logit = self.head_max_logit.amax()
        # `is_causal` is `blocked("causal")` in the kernels themselves (no mask in memory; a test holds the two
        # equal); any other pattern goes as a mask.
        mask = (
            {"is_causal": True}
            if self.pattern == "causal"
            else {"attn_mask": ~self.blocked(self.pattern, T, T, 0, x.device)}
        )
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, scale=self.scale, **mask, **gqa
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def _max_causal_logit(self, q: torch.Tensor, k: torch.Tensor, rows: int = 256) -> torch.Tensor:
        """Each head's largest pre-softmax logit a query gives a key it may see (`blocked`), (n_head,), on the
        batch's first sequence (logit growth is the weights'), `rows` queries at a time: QK^T stays small."""
        q, k = q[0].float(), k[0].float()
        T = q.shape[-2]
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)
        best = None
        for start in range(0, T, rows):
            stop = min(start + rows, T)
            hidden = _additive(type(self).blocked, self.pattern, stop - start, stop, start, q.device)
            logits = torch.baddbmm(hidden, q[:, start:stop], k[:, :stop].mT)
            chunk = logits.amax(dim=(-2, -1))
            best = chunk if best is None else torch.maximum(best, chunk)
        return best * scale  # scale > 0: the max of the scaled logits, without scaling every one
