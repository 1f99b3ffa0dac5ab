"""A decoder-only transformer, GPT-2 or Llama shaped by `GPTConfig`'s switches. Module names are the same in both
families (`wte`, `blocks.N.attn.qkv`, `blocks.N.mlp.fc`, `ln_f`, `lm_head`), so the stability callbacks, fault
injectors and export read either one. Which keys a query may see is defined once, by `CausalSelfAttention.blocked`."""

from __future__ import annotations

import functools
import math
from collections.abc import Hashable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from steadylm.model import mup
from steadylm.model.config import GPTConfig
from steadylm.model.init import init_weights, layer, make_norm
from steadylm.model.recompute import run_block
from steadylm.model.switches import require_understood

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

IGNORE_INDEX = -100  # the target of a padding position: the loss leaves it out (torch's cross_entropy default)


def rope_tables(
    head_dim: int, context_length: int, theta: float, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, each (context_length, 1, head_dim), fp32; sin's first half negated: applying them is a roll."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is not None:  # `model.rope_scaling`
        from steadylm.model.llama3_rope import llama3_frequencies

        inv_freq = llama3_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(context_length, dtype=torch.int64).float(), inv_freq).repeat(1, 2)
    sin = angles.sin()
    sin[:, : head_dim // 2] *= -1
    return angles.cos().unsqueeze(1), sin.unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, T, heads, head_dim) by tables (T, 1, head_dim), keeping x's dtype: x·cos + roll(x, half)·sin."""
    return (x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin).to(x.dtype)


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """`model.logit_softcap`: cap·tanh(logits/cap) in fp32, as the loss reads it (|logits| < cap); None: unchanged."""
    return logits if cap is None else cap * torch.tanh(logits.float() / cap)


def documents(idx: torch.Tensor, separator: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`data.pack=doc`: (the document each position is in, its position within it), each (B, T) int64. A separator
    opens the document after it (it plays BOS, as in `data.align=doc`), so a document's first prediction sees the
    separator alone, exactly as that document run on its own after one."""
    opens = idx == separator
    at = torch.arange(idx.shape[1], device=idx.device).expand_as(idx)
    return opens.cumsum(1), at - torch.where(opens, at, 0).cummax(1).values


def doc_kernel(device_type: str, dropout: float, causal: bool = True) -> tuple[str, str]:
    """`data.pack=doc`'s attention kernel on `device_type`, and the startup line that says which and why: `flex` on
    CUDA (FlexAttention, compiled, with a block mask built once per batch: it skips the blocks that a document
    boundary hides), else `mask` (an explicit (B, 1, T, T) mask to SDPA, which every device runs and which composes
    with any attention pattern). FlexAttention has no backward on a CPU and no dropout; a variable-length SDPA would
    need each batch unpadded into one sequence of documents."""
    if device_type == "cuda" and not dropout and causal:
        return "flex", "data.pack=doc: attention by FlexAttention with a document block mask per batch on cuda"
    why = "FlexAttention has no backward there" if device_type != "cuda" else "FlexAttention has no dropout"
    why = why if causal else "a layer's attention pattern is not causal"
    return "mask", f"data.pack=doc: attention by SDPA with an explicit (B, 1, T, T) mask on {device_type} ({why})"


def doc_block_mask(docs: torch.Tensor) -> BlockMask:
    """FlexAttention's block mask for documents `docs` (B, T): a query sees its own document's earlier keys."""
    from torch.nn.attention.flex_attention import create_block_mask  # loaded by packed runs on the flex kernel

    def visible(b, h, q, k):
        return (k <= q) & (docs[b, q] == docs[b, k])

    return create_block_mask(visible, docs.shape[0], None, docs.shape[1], docs.shape[1], device=docs.device)


@functools.cache
def _flex(compiled: bool):
    """FlexAttention: compiled (its fused kernel, on CUDA) or eager (any device, forward only on a CPU)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if compiled else flex_attention


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

    def forward(self, x: torch.Tensor, rope=None, docs=None, block_mask=None) -> torch.Tensor:
        """x (B, T, C); `rope`: (cos, sin) for these positions, each (T, 1, D) or (B, T, 1, D), or None (learned
        positions); `docs` when documents are packed (no query sees another's keys): each position's document (B, T),
        and on the flex kernel their block mask (`doc_block_mask`)."""
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
            self.head_max_logit = self._max_causal_logit(q.detach(), kk.detach(), None if docs is None else docs[0])
            self.max_logit = self.head_max_logit.amax()
        if block_mask is not None:  # the flex kernel (`doc_kernel`)
            y = _flex(x.is_cuda)(q, k, v, block_mask=block_mask, scale=self.scale, enable_gqa=bool(gqa))
            return self.proj(y.transpose(1, 2).reshape(B, T, C))
        # `is_causal` is `blocked("causal")` in the kernels (no mask in memory; a test holds the two equal).
        causal = self.pattern == "causal" and docs is None
        mask = {"is_causal": True} if causal else {"attn_mask": ~self.blocked(self.pattern, T, T, 0, x.device)}
        if docs is not None:  # an explicit (B, 1, T, T) mask: SDPA's kernels with masks on every device
            mask = {"attn_mask": mask["attn_mask"] & (docs[:, None, :, None] == docs[:, None, None, :])}
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, scale=self.scale, **mask, **gqa)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def _max_causal_logit(self, q: torch.Tensor, k: torch.Tensor, docs=None, rows: int = 256) -> torch.Tensor:
        """Each head's largest pre-softmax logit that attention uses (n_head,), on the batch's first sequence, `rows`
        at a time: QK-clip and the stats read it, so a pair the mask hides (the future; with `docs`, that sequence's
        documents (T,), another document) never counts, however large."""
        q, k, T, best = q[0].float(), k[0].float(), q.shape[-2], []
        for start in range(0, T, rows):
            stop = min(start + rows, T)
            hidden = _additive(type(self).blocked, self.pattern, stop - start, stop, start, q.device)
            if docs is not None:
                hidden = hidden.masked_fill(docs[start:stop, None] != docs[None, :stop], float("-inf"))
            best.append(torch.baddbmm(hidden, q[:, start:stop], k[:, :stop].mT).amax(dim=(-2, -1)))
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(self.head_dim)
        return torch.stack(best).amax(0) * scale  # scale > 0: the max of the scaled logits, without scaling each


class MLP(nn.Module):
    """GELU (GPT-2, exact or tanh) or SwiGLU (Llama), whose gate and up projections are one `fc` (export splits it)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.approximate = "tanh" if cfg.mlp == "gelu_tanh" else "none"
        self.fc = layer(nn.Linear, cfg.init, cfg.d_model, (2 if self.swiglu else 1) * cfg.hidden, bias=cfg.bias)
        self.proj = layer(nn.Linear, cfg.init, cfg.hidden, cfg.d_model, bias=cfg.bias)
        self.proj.is_residual_proj = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.fc(x).chunk(2, dim=-1)
            return self.dropout(self.proj(F.silu(gate) * up))
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate=self.approximate)))  # tanh: 1.7x on a CPU


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = make_norm(cfg, cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = make_norm(cfg, cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope=None, docs=None, block_mask=None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope, docs, block_mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = layer(nn.Embedding, cfg.init, cfg.vocab_size, cfg.d_model)
        self.wpe = layer(nn.Embedding, cfg.init, cfg.context_length, cfg.d_model) if cfg.pos == "learned" else None
        if self.wpe is None:
            cos, sin = rope_tables(cfg.head_dim, cfg.context_length, cfg.rope_theta, cfg.rope_scaling)
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
        self.doc_separator: int | None = None  # data.pack=doc: the id that opens each packed document (`documents`)
        self.doc_kernel = "mask"  # its attention kernel: mask (every device) or flex (`choose_doc_kernel`)

    def forward(self, idx: torch.Tensor, head: bool = True) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, vocab_size), or with `head=False` the head's input (`head_loss`)."""
        T = idx.shape[1]
        if T > self.cfg.context_length:
            raise ValueError(f"sequence length {T} > model.context_length={self.cfg.context_length}")
        docs, block_mask, pos, rows = None, None, torch.arange(T, device=idx.device), slice(T)
        if self.doc_separator is not None:  # positions restart at each document
            docs, pos = documents(idx, self.doc_separator)
            rows = pos
            if self.doc_kernel == "flex":  # one block mask per batch, shared by every layer
                block_mask = doc_block_mask(docs)
        rope = None if self.wpe is not None else (self.rope_cos[rows], self.rope_sin[rows])
        x = self.drop(self.wte(idx) if rope else self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = run_block(block, self.cfg.activation_checkpointing, x, rope, docs, block_mask)
        if self.track_residual:
            self.residual_rms = x.detach().float().pow(2).mean().sqrt()
        x = self.ln_f(x)
        if self.logit_mult != 1.0:
            x = x * self.logit_mult
        return softcap(self.lm_head(x), self.cfg.logit_softcap) if head else x

    def choose_doc_kernel(self, device_type: str) -> str:
        """Set the packed documents' attention kernel for `device_type` (`doc_kernel`); return the line saying which."""
        causal = all(b.attn.pattern == "causal" for b in self.blocks)
        self.doc_kernel, line = doc_kernel(device_type, self.cfg.dropout, causal)
        return line

    def num_params(self, non_embedding: bool = True) -> int:
        """A tied matrix once; `non_embedding` drops the tables only looked up, never multiplied (the 6N rule)."""
        tables = [self.wpe, None if self.cfg.tie_embeddings else self.wte] if non_embedding else []
        return sum(p.numel() for p in self.parameters()) - sum(t.weight.numel() for t in tables if t is not None)

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for the matmuls plus 12·L·d·T for the scores (PaLM appendix B)."""
        require_understood(self.cfg, "flops")
        return 6 * self.num_params() + 12 * self.cfg.n_layer * self.cfg.d_model * self.cfg.context_length


# The output head's cross-entropy over chunks of tokens: the (tokens x vocab) logits never exist whole. Each chunk's
# gradients are computed in the forward while its logits exist (as Liger's fused linear cross-entropy); the backward
# only scales them. Numerics follow the plain path: matmuls in the autocast dtype, the rest in fp32.
class _HeadLoss(torch.autograd.Function):
    """Mean over non-ignored targets of CE + z_coeff * (log Z)^2 (logits capped by `cap`), CE and z riding along."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, z_coeff: float, chunk: int, dtype: torch.dtype, cap, keep: bool):
        with torch.autocast(hidden.device.type, enabled=False):
            w, need = weight.to(dtype), ctx.needs_input_grad
            grad_h = torch.empty_like(hidden) if need[0] else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need[1] else None
            # 1/count before the gradients are rounded to the matmul dtype, where the plain path applies it too.
            inv = 1.0 / (targets != IGNORE_INDEX).sum().clamp(min=1).float()  # all padding: 0, not NaN
            ce_sum, z_sum, lz_sum = torch.zeros(3, dtype=torch.float32, device=hidden.device)
            losses = torch.empty(hidden.shape[0] if keep else 0, dtype=torch.float32, device=hidden.device)
            for s in range(0, hidden.shape[0], chunk):
                h, t = hidden[s : s + chunk].to(dtype), targets[s : s + chunk]
                # One fused log-softmax; log Z read back at the target's column (logit - log-prob).
                logits = F.linear(h, w).float()
                if cap is not None:
                    logits = (tanh := logits.div_(cap).tanh_()) * cap
                logp = torch.log_softmax(logits, dim=-1)
                col, valid = t.clamp(min=0)[:, None], t != IGNORE_INDEX
                picked = logp.gather(1, col).squeeze(1)
                lse = logits.gather(1, col).squeeze(1) - picked
                nll = torch.where(valid, -picked, 0.0)  # as cross_entropy: an ignored row is 0, even if inf
                ce_sum += nll.sum()
                lse = torch.where(valid, lse, 0.0)
                z_sum += lse.square().sum()
                lz_sum += lse.sum()
                if keep:
                    losses[s : s + chunk] = nll
                if grad_h is None and grad_w is None:
                    continue
                # d/dlogits of CE + z (log Z)^2 = softmax * (1 + 2 z log Z) - onehot(target), on valid rows only.
                row = torch.where(valid, (1 + 2 * z_coeff * lse) * inv, 0.0)
                g = logp.exp_().mul_(row[:, None])  # the softmax, in the log-softmax's own buffer
                g = g.scatter_add_(1, col, -(valid * inv)[:, None])  # through a cap: d/dz cap·tanh(z/cap) = 1 - tanh²
                g = (g if cap is None else g.mul_(1 - tanh.square())).to(dtype)
                if grad_h is not None:
                    grad_h[s : s + chunk] = g @ w
                if grad_w is not None:
                    grad_w += (g.t() @ h).float()
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if grad_w is not None else None)
        ce, z, log_z = ce_sum * inv, z_coeff * z_sum * inv, lz_sum * inv
        ctx.mark_non_differentiable(ce, z, log_z, losses)
        return ce + z, ce, z, log_z, losses

    @staticmethod
    def backward(ctx, grad_loss, *_no_grad):
        grad_h, grad_w = ctx.saved_tensors
        grad_h = grad_h * grad_loss.to(grad_h.dtype) if grad_h is not None else None
        grad_w = grad_w * grad_loss.to(grad_w.dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None, None


class HeadLoss(NamedTuple):
    """`chunked_head_loss`'s outputs: only `loss` carries a gradient."""

    loss: torch.Tensor  # CE + z-loss, a mean over non-ignored targets (0 when all are ignored)
    ce: torch.Tensor
    z: torch.Tensor  # the z-loss term
    log_z: torch.Tensor  # the mean log Z (log-sum-exp of the logits) over non-ignored targets: a free by-product
    token_losses: torch.Tensor | None  # per-target CE shaped like `targets` (0 at ignored ones), when asked for


def chunked_head_loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, z_coeff: float = 0.0, chunk: int = 1024, cap=None,
    token_losses: bool = False,
) -> HeadLoss:  # fmt: skip
    """CE + z-loss of the head `weight` (vocab, d) on its input `hidden` (..., d) against `targets` (...) int64, by
    chunks; `token_losses` also keeps each target's CE (one float a token, for a check that asks for it)."""
    h, dev = hidden.reshape(-1, hidden.shape[-1]), hidden.device.type
    if not torch.is_grad_enabled():  # no_grad (validation): skip the gradients the forward would otherwise compute
        h, weight = h.detach(), weight.detach()
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype  # the matmul's
    out = _HeadLoss.apply(h, weight, targets.reshape(-1), float(z_coeff), int(chunk), dtype, cap, bool(token_losses))
    return HeadLoss(*out[:4], out[4].view(targets.shape) if token_losses else None)


@torch.no_grad()
def chunked_token_losses(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 1024, cap: float | None = None
) -> torch.Tensor:
    """Per-token cross-entropy (fp32, 0 at ignored targets) of the `cap`ped logits, shaped like `targets`, by chunks."""
    h, t, dev = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    with torch.autocast(dev, enabled=False):
        w = weight.to(dtype)
        ce = functools.partial(F.cross_entropy, ignore_index=IGNORE_INDEX, reduction="none")
        logits = lambda s: softcap(F.linear(h[s : s + chunk].to(dtype), w).float(), cap)
        out = [ce(logits(s), t[s : s + chunk]) for s in range(0, len(h), chunk)]
    return torch.cat(out).view(targets.shape)
