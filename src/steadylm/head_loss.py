"""The output head and cross-entropy over chunks of tokens: the (tokens x vocab) logits never exist whole. Each
chunk's gradients are computed in the forward while its logits exist (as Liger's fused linear cross-entropy); the
backward only scales them. Numerics follow the plain path: matmuls in the autocast dtype, the rest in fp32."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from steadylm.data.dataset import IGNORE_INDEX


class _HeadLoss(torch.autograd.Function):
    """Mean over non-ignored targets of CE + z_coeff * (log Z)^2, with the CE and z terms riding along (no grad)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, z_coeff: float, chunk: int, dtype: torch.dtype):
        with torch.autocast(hidden.device.type, enabled=False):
            w, need = weight.to(dtype), ctx.needs_input_grad
            grad_h = torch.empty_like(hidden) if need[0] else None
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need[1] else None
            # 1/count before the gradients are rounded to the matmul dtype, where the plain path applies it too.
            inv = 1.0 / (targets != IGNORE_INDEX).sum().clamp(min=1).float()  # all padding: 0, not NaN
            ce_sum, z_sum = torch.zeros(2, dtype=torch.float32, device=hidden.device)
            for s in range(0, hidden.shape[0], chunk):
                h, t = hidden[s : s + chunk].to(dtype), targets[s : s + chunk]
                # One fused log-softmax; log Z read back at the target's column (logit - log-prob).
                logits = F.linear(h, w).float()
                logp = torch.log_softmax(logits, dim=-1)
                col, valid = t.clamp(min=0)[:, None], t != IGNORE_INDEX
                picked = logp.gather(1, col).squeeze(1)
                lse = logits.gather(1, col).squeeze(1) - picked
                ce_sum += torch.where(valid, -picked, 0.0).sum()  # as cross_entropy: an ignored row is 0, even if inf
                z_sum += torch.where(valid, lse.square(), 0.0).sum()
                if grad_h is None and grad_w is None:
                    continue
                # d/dlogits of CE + z (log Z)^2 = softmax * (1 + 2 z log Z) - onehot(target), on valid rows only.
                row = torch.where(valid, (1 + 2 * z_coeff * lse) * inv, 0.0)
                g = logp.exp_().mul_(row[:, None])  # the softmax, in the log-softmax's own buffer
                g = g.scatter_add_(1, col, -(valid * inv)[:, None]).to(dtype)
                if grad_h is not None:
                    grad_h[s : s + chunk] = g @ w
                if grad_w is not None:
                    grad_w += (g.t() @ h).float()
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype) if grad_w is not None else None)
        ce, z = ce_sum * inv, z_coeff * z_sum * inv
        ctx.mark_non_differentiable(ce, z)
        return ce + z, ce, z

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_z):
        grads = [None if g is None else g * grad_loss.to(g.dtype) for g in ctx.saved_tensors]
        return *grads, None, None, None, None


def chunked_head_loss(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, z_coeff: float = 0.0, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CE + z-loss, CE, z-loss), each a mean over non-ignored targets (0 when all are ignored); only the first
    carries a gradient. `hidden` (..., d) is the input of the head `weight` (vocab, d); `targets` (...) int64."""
    h, dev = hidden.reshape(-1, hidden.shape[-1]), hidden.device.type
    if not torch.is_grad_enabled():  # no_grad (validation): skip the gradients the forward would otherwise compute
        h, weight = h.detach(), weight.detach()
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype  # the matmul's
    return _HeadLoss.apply(h, weight, targets.reshape(-1), float(z_coeff), int(chunk), dtype)


@torch.no_grad()
def chunked_token_losses(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = 1024
) -> torch.Tensor:
    """Per-token cross-entropy (fp32, 0 at ignored targets), shaped like `targets`, a chunk of logits at a time."""
    h, t, dev = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1), hidden.device.type
    dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
    with torch.autocast(dev, enabled=False):
        w = weight.to(dtype)
        ce = functools.partial(F.cross_entropy, ignore_index=IGNORE_INDEX, reduction="none")
        out = [ce(F.linear(h[s : s + chunk].to(dtype), w).float(), t[s : s + chunk]) for s in range(0, len(h), chunk)]
    return torch.cat(out).view(targets.shape)
