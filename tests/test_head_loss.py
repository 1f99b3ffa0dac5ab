"""The chunked head + loss (the default) gives the plain path's loss, z-loss and gradients, fp32 and bf16, with
padding, tied or untied heads and muP's output multiplier; its per-target losses are the plain ones."""

import pytest
import torch
import torch.nn.functional as F

from steadylm.errors import ConfigError
from steadylm.model.gpt import chunked_head_loss
from steadylm.module import LMModule
from steadylm.stability.suspects import sample_losses

MODEL = dict(n_layer=1, n_head=2, d_model=32, context_length=16, vocab_size=200)
MUP = dict(tie_embeddings=False, parametrization="mup", mup_base_width=16, mup_output_mult=2.0)
CAP = dict(logit_softcap=0.5)  # logits of a few tenths: the cap bends them, so the tanh's gradient is tested
MODELS = dict(argnames="model", argvalues=[{}, MUP, CAP, {**MUP, **CAP}], ids=["tied", "mup-untied", "cap", "mup-cap"])


def batch():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 200, (3, 16), generator=g), torch.randint(0, 200, (3, 16), generator=g)
    y[0, :5] = -100  # padding
    y[2] = -100  # a whole padded row
    return x, y


def step(path, precision, z_loss, **model):
    torch.manual_seed(0)
    module = LMModule(model={**MODEL, **model}, optim=dict(lr=1e-3, z_loss=z_loss, loss=path, loss_chunk=7))
    x, y = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        loss, z = module.head_loss(x, y)
    loss.backward()
    return loss.item(), z.item(), {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize(**MODELS)
@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_chunked_equals_plain_in_fp32(model, z_loss):
    plain, chunked = step("plain", "fp32", z_loss, **model), step("chunked", "fp32", z_loss, **model)
    assert chunked[0] == pytest.approx(plain[0], abs=1e-5)
    assert chunked[1] == pytest.approx(plain[1], abs=1e-5)
    assert (chunked[1] > 0) == (z_loss > 0)
    for name, grad in plain[2].items():
        torch.testing.assert_close(chunked[2][name], grad, atol=1e-5, rtol=0, msg=name)


@pytest.mark.parametrize(**MODELS)
def test_chunked_equals_plain_in_bf16(model):
    """Loss and every gradient below the head equal; the head's own gradient is summed over chunks in fp32 where the
    plain path rounds one bf16 matmul, so the two may differ by one bf16 step at the gradient's scale."""
    head = "net.lm_head.weight" if "tie_embeddings" in model else "net.wte.weight"
    plain, chunked = step("plain", "bf16", 0.0, **model), step("chunked", "bf16", 0.0, **model)
    assert chunked[0] == pytest.approx(plain[0], abs=1e-5)
    for name, grad in plain[2].items():
        if name != head:
            torch.testing.assert_close(chunked[2][name], grad, atol=1e-5, rtol=0, msg=name)
    ulp = plain[2][head].abs().max().item() * 2**-8  # bf16 resolution at the gradient's scale
    torch.testing.assert_close(chunked[2][head], plain[2][head], atol=ulp, rtol=0)


@pytest.mark.parametrize("model", [{}, CAP], ids=["uncapped", "cap"])
def test_per_target_losses_val_sum_and_suspects_follow_the_plain_path(model):
    torch.manual_seed(0)
    module = LMModule(model={**MODEL, **model}, optim=dict(lr=1e-3, loss_chunk=5))
    assert module.loss_path == "chunked"
    x, y = batch()
    plain = F.cross_entropy(module(x).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="none").view(y.shape)
    torch.testing.assert_close(module.target_losses(x, y), plain, atol=1e-6, rtol=0)
    rows = sample_losses(module, [(x, y)])
    assert [r for _, r, _ in rows] == [0, 1]  # the padded row is left out
    valid = (y != -100).float()
    for _, r, loss in rows:
        assert loss == pytest.approx(float((plain[r] * valid[r]).sum() / valid[r].sum()), abs=1e-5)


def test_no_grad_and_all_padding():
    h, w = torch.randn(6, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    with torch.no_grad():
        loss, ce, z, log_z, _ = chunked_head_loss(h, w, torch.full((6,), -100), z_coeff=1e-4, chunk=4)
    assert (loss.item(), ce.item(), z.item(), log_z.item()) == (0.0, 0.0, 0.0, 0.0)
    assert not loss.requires_grad


@pytest.mark.parametrize("key,value,match", [("loss", "fused", "optim.loss"), ("loss_chunk", 0, "optim.loss_chunk")])
def test_bad_loss_keys_are_one_config_error(key, value, match):
    with pytest.raises(ConfigError, match=match):
        LMModule(model=MODEL, optim={"lr": 1e-3, key: value})


def test_suspects_on_a_snapshot_use_its_weights_not_the_live_ones():
    torch.manual_seed(0)
    live, other = LMModule(model=MODEL, optim=dict(lr=1e-3)), LMModule(model=MODEL, optim=dict(lr=1e-3))
    tensors = [t.detach().clone() for t in [*other.parameters(), *other.buffers()]]
    snapshot = type("Snapshot", (), {"weights": lambda self: tensors})()
    x, y = batch()
    losses = lambda module, weights=None: [v for *_, v in sample_losses(module, [(x, y)], weights)]  # noqa: E731
    assert losses(live, snapshot) == pytest.approx(losses(other), abs=1e-6)
    assert losses(live, snapshot) != pytest.approx(losses(live), abs=1e-3)


@pytest.mark.parametrize("cap", [None, 3.0], ids=["uncapped", "cap"])
def test_the_chunked_loss_gives_log_z_and_per_target_losses_of_the_plain_logits(cap):
    """log Z (the stats' signal) and each target's CE (what a check may ask for) come out of the same chunks."""
    torch.manual_seed(0)
    h, w = torch.randn(2, 7, 8), torch.randn(20, 8)
    y = torch.randint(0, 20, (2, 7))
    y[1, 4:] = -100
    out = chunked_head_loss(h, w, y, chunk=3, cap=cap, token_losses=True)
    logits = h @ w.t()
    logits = logits if cap is None else cap * torch.tanh(logits / cap)
    valid = y != -100
    assert out.log_z.item() == pytest.approx(logits.logsumexp(-1)[valid].mean().item(), rel=1e-5)
    plain = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100, reduction="none").view(y.shape)
    torch.testing.assert_close(out.token_losses, plain, atol=1e-5, rtol=0)
    assert chunked_head_loss(h, w, y, chunk=3, cap=cap).token_losses is None  # not asked: not kept
