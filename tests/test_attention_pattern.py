"""Which keys a query may see is defined once (`CausalSelfAttention.blocked`): the forward and the max-logit
measurement both follow it, so a pattern added in a subclass (here a sliding window) changes both."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from steadylm.model import GPTConfig
from steadylm.model.gpt import CausalSelfAttention

CFG = GPTConfig(n_layer=1, n_head=2, d_model=32, context_length=16, vocab_size=64, init="torch_default")
W = 4


class Windowed(CausalSelfAttention):
    """A fork's sliding window: each query sees itself and the W - 1 keys before it."""

    pattern = ("window", W)

    @staticmethod
    def blocked(pattern, rows, cols, start, device):
        causal = CausalSelfAttention.blocked("causal", rows, cols, start, device)
        if pattern == "causal":
            return causal
        queries = torch.arange(start, start + rows, device=device).unsqueeze(1)
        return causal | (torch.arange(cols, device=device) <= queries - pattern[1])


def test_sdpas_causal_path_is_the_causal_definition():
    q, k, v = (torch.randn(2, 2, 16, 8) for _ in range(3))
    mask = ~CausalSelfAttention.blocked("causal", 16, 16, 0, q.device)
    fast = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(fast, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cls", [CausalSelfAttention, Windowed])
def test_the_forward_follows_the_pattern(cls):
    """Changing the first token moves every output that may see it: all of them under causal, the first W in
    the window."""
    torch.manual_seed(0)
    attn = cls(CFG).eval()
    x = torch.randn(1, 16, 32)
    y = x.clone()
    y[0, 0] += 1.0
    moved = (attn(x) - attn(y)).abs().amax(dim=-1)[0] > 0
    assert moved.tolist() == [True] * (W if cls is Windowed else 16) + [False] * (16 - W if cls is Windowed else 0)


def test_the_max_logit_measurement_asks_the_pattern():
    """Head 1's largest logit is the last query on key 0, which the window hides: the measurement skips it."""
    torch.manual_seed(0)
    q, k = torch.randn(1, 2, 16, 16), torch.randn(1, 2, 16, 16)
    k[0, 1, 0] = 50.0 * q[0, 1, 15]
    logits = (q[0] @ k[0].mT) / math.sqrt(16)
    for cls in (CausalSelfAttention, Windowed):
        attn = cls(CFG)
        hidden = cls.blocked(cls.pattern, 16, 16, 0, q.device)
        expected = logits.masked_fill(hidden, float("-inf")).amax(dim=(-2, -1))
        for rows in (3, 16):
            assert attn._max_causal_logit(q, k, rows=rows).tolist() == pytest.approx(expected.tolist(), rel=1e-6)
    causal, windowed = CausalSelfAttention(CFG)._max_causal_logit(q, k), Windowed(CFG)._max_causal_logit(q, k)
    assert causal[1] == causal.max() and windowed[1] < causal[1] / 2  # the causal max is the hidden one
