"""`model.activation_checkpointing`: blocks and selective give none's gradients, and recompute what they say they do
(selective: the elementwise ops, never a matmul; blocks: the whole block, its matmuls too); the memory estimate
counts what each keeps."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from steadylm.config import compose
from steadylm.devices import Devices
from steadylm.memory import plan
from steadylm.model import GPT, GPTConfig, recompute

keep_matmuls = recompute._keep_matmuls

SHAPES = [{}, {"pos": "rope", "mlp": "swiglu", "norm": "rmsnorm", "n_kv_head": 1, "dropout": 0.1}]


def _step(mode: str, compiled: bool = False, **switches) -> torch.Tensor:
    """The gradients of one forward and backward (`compiled`: through `torch.compile`)."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, d_model=64, context_length=32, vocab_size=320, **switches)
    net = GPT(GPTConfig(**{**vars(cfg), "activation_checkpointing": mode}))
    x = torch.randint(0, 320, (4, 32), generator=torch.Generator().manual_seed(1))
    (torch.compile(net) if compiled else net)(x).float().logsumexp(-1).mean().backward()
    return torch.cat([p.grad.flatten() for p in net.parameters()])


@pytest.mark.parametrize("switches", SHAPES, ids=["gpt2", "llama"])
def test_blocks_and_selective_give_the_gradients_of_none(switches):
    grads = _step("none", **switches)
    for mode in ("blocks", "selective"):
        assert (_step(mode, **switches) - grads).norm() <= 1e-6 * grads.norm(), mode


@pytest.mark.slow
def test_blocks_and_selective_under_torch_compile_give_the_gradients_of_eager_none():
    grads = _step("none")
    for mode in ("blocks", "selective"):
        assert (_step(mode, compiled=True) - grads).norm() <= 1e-6 * grads.norm(), mode


def test_selective_keeps_what_the_matmuls_and_attention_produce_and_recomputes_the_rest(monkeypatch):
    """The policy meets a block's real ops (a linear layer arrives as addmm, attention as the fused kernel): those
    are kept, the elementwise ones between them (norms, GELU, residual adds) recomputed."""
    seen = {}

    def recording(ctx, op, *args, **kwargs):
        seen[str(op)] = decision = keep_matmuls(ctx, op, *args, **kwargs)
        return decision

    monkeypatch.setattr(recompute, "_keep_matmuls", recording)
    _step("selective")
    kept = {op for op, d in seen.items() if d == CheckpointPolicy.MUST_SAVE}
    assert {"aten.addmm.default", "aten._scaled_dot_product_flash_attention_for_cpu.default"} <= kept
    assert seen["aten.gelu.default"] == seen["aten.native_layer_norm.default"] == CheckpointPolicy.PREFER_RECOMPUTE


def test_the_memory_estimate_counts_what_each_mode_keeps(tmp_path):
    cfg = compose(["model=small", f"paths.output_dir={tmp_path}"])
    one = Devices("cpu", 1, 1)
    acts = {m: plan(cfg, "32-true", one, 8, 10**6, m).parts["activations"] for m in ("none", "selective", "blocks")}
    per_value = 8 * cfg.model.context_length * cfg.model.d_model * 4  # one d_model-wide fp32 value for every token
    L = cfg.model.n_layer
    assert acts == {"none": 17 * L * per_value, "selective": (11 * L + 17) * per_value, "blocks": (L + 17) * per_value}
