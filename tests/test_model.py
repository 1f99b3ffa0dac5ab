"""The transformer (GPT-2 defaults): causality, initial loss, init schemes, FLOP formula.

The Llama-family switches and their combinations: tests/test_model_switches.py."""

import math

import pytest
import torch
import torch.nn.functional as F

from steadylm.errors import ConfigError
from steadylm.model import GPT, GPTConfig


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=4, d_model=64, context_length=32, vocab_size=320, **kw))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_changing_future_tokens_leaves_past_logits_unchanged(qk_norm):
    model = tiny(qk_norm=qk_norm).eval()
    x = torch.randint(0, 320, (2, 32))
    y = x.clone()
    y[:, 20:] = torch.randint(0, 320, (2, 12))
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :20], b[:, :20], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_initial_loss_is_close_to_log_vocab():
    model = tiny()
    x = torch.randint(0, 320, (4, 32))
    targets = torch.randint(0, 320, (4, 32))
    loss = F.cross_entropy(model(x).view(-1, 320), targets.view(-1))
    assert abs(loss.item() - math.log(320)) < 0.1


def test_weights_are_tied_and_residual_projections_scaled():
    model = GPT(GPTConfig(n_layer=8, d_model=256, n_head=4, vocab_size=320, context_length=32))
    assert model.lm_head.weight is model.wte.weight
    fc_std = model.blocks[0].mlp.fc.weight.std().item()
    proj_std = model.blocks[0].mlp.proj.weight.std().item()
    assert fc_std == pytest.approx(0.02, rel=0.05)
    assert proj_std == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


def test_init_schemes_differ_and_unknown_is_refused():
    stds = {s: tiny(init=s).blocks[0].mlp.fc.weight.std().item() for s in ("gpt2", "xavier", "torch_default")}
    assert stds["gpt2"] == pytest.approx(0.02, rel=0.05)
    assert stds["xavier"] == pytest.approx(math.sqrt(2 / (64 + 256)), rel=0.1)
    assert stds["torch_default"] != pytest.approx(stds["gpt2"], rel=0.2)
    with pytest.raises(ConfigError, match="model.init='he' is not allowed; use one of: gpt2, xavier, torch_default"):
        tiny(init="he")


def test_sequence_longer_than_context_is_refused():
    with pytest.raises(ValueError, match="model.context_length=32"):
        tiny()(torch.zeros(1, 33, dtype=torch.long))


def test_max_logit_is_tracked_only_when_asked():
    model = tiny()
    x = torch.randint(0, 320, (1, 32))
    model(x)
    attn = model.blocks[0].attn
    assert attn.max_logit is None
    attn.track_max_logit = True
    model(x)
    assert torch.isfinite(attn.max_logit) and attn.max_logit.ndim == 0
    assert attn.head_max_logit.shape == (attn.n_head,) and attn.head_max_logit.max() == attn.max_logit


def test_max_logit_in_row_chunks_equals_the_full_causal_max():
    """Chunk edges and the causal offset: every chunk size gives each head's brute-force max of sequence 0."""
    attn = tiny().blocks[0].attn
    hd = attn.head_dim
    q, k = torch.randn(2, attn.n_head, 32, hd), torch.randn(2, attn.n_head, 32, hd)
    q[1] *= 100  # the second sequence is not part of the measurement
    k[0, 1, 31] = 50.0 * q[0, 1, 31]  # head 1's largest logit: last query on last key, in the last chunk only
    full = (q[0] @ k[0].transpose(-2, -1)) / math.sqrt(hd)
    expected = full.masked_fill(torch.ones(32, 32, dtype=torch.bool).triu(1), float("-inf")).amax(dim=(-2, -1))
    assert expected.argmax() == 1
    for rows in (1, 5, 31, 32, 256):
        assert attn._max_causal_logit(q, k, rows=rows).tolist() == pytest.approx(expected.tolist(), rel=1e-6)


def test_flops_per_token_matches_a_flop_counter():
    """6N + 12·L·d·T against torch's own FLOP counter on one forward+backward."""
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny()
    B, T = 2, model.cfg.context_length
    x = torch.randint(0, 320, (B, T))
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    counted = counter.get_total_flops() / (B * T)
    assert counted == pytest.approx(model.flops_per_token(), rel=0.1)
