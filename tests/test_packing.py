"""`data.pack=doc`: documents packed end to end, attention never crossing an end-of-text id, positions restarting.

Held exactly: one document's loss has no gradient through another's tokens, and a packed window scores each document
as that document run alone after a separator."""

from __future__ import annotations

import logging

import pytest
import torch

from steadylm.model import GPT, GPTConfig
from steadylm.model.gpt import documents
from steadylm.module import LMModule
from steadylm.train import train

SEP = 0
# Three documents in one window: the tail of one that began in an earlier window, then two whole ones.
WINDOW = torch.tensor([[5, 9, 3, SEP, 7, 8, 9, 4, 2, SEP, 6, 1, 3, 3, 5, 8]])
DOCS = [(0, 3), (3, 9), (9, 16)]  # [start, end) of each document's inputs; a separator opens the one after it
FAMILIES = {
    "gpt2": {"pos": "learned"},
    "llama": {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "n_kv_head": 1},
}


def net_of(family: str) -> GPT:
    torch.manual_seed(0)
    net = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, context_length=16, vocab_size=64, **FAMILIES[family]))
    net.doc_separator = SEP
    return net


def test_documents_number_and_positions_restart_at_each_separator():
    docs, pos = documents(WINDOW, SEP)
    assert docs.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5, 6]]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_no_gradient_flows_between_documents(family):
    """The loss of each document, backpropagated to every position's input embedding: exactly 0 outside it."""
    net, embedded = net_of(family), []

    def keep(module, inputs, out):
        out.retain_grad()
        embedded.append(out)

    net.wte.register_forward_hook(keep)
    for start, end in DOCS:
        embedded.clear()
        logits = net(WINDOW)
        logits[0, start:end].float().logsumexp(-1).sum().backward()
        grad = embedded[0].grad[0].abs().sum(-1)
        outside = torch.cat([grad[:start], grad[end:]])
        assert torch.equal(outside, torch.zeros_like(outside)), (family, start, end, outside)
        assert (grad[start:end] > 0).all()
        net.zero_grad()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_packed_window_scores_each_document_as_it_alone(family):
    """Per-target losses through the module's own path (chunked), packed against each document run alone; a whole
    document alone starts with its separator, the window's first (partial) document at position 0."""
    module = LMModule(model=dict(net_of(family).cfg.__dict__), optim={"lr": 1e-3}, doc_separator=SEP)
    module.net.load_state_dict(net_of(family).state_dict())
    x, y = WINDOW[:, :-1], WINDOW[:, 1:]
    packed = module.target_losses(x, y)[0]
    for start, end in DOCS:
        end = min(end, x.shape[1])
        alone = module.target_losses(x[:, start:end], y[:, start:end])[0]
        assert torch.allclose(packed[start:end], alone, atol=1e-5, rtol=0), (family, start, packed[start:end], alone)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.filterwarnings("ignore:.*flex_attention.*:UserWarning")
@pytest.mark.parametrize("T", [16, 300])  # within one of FlexAttention's 128-token blocks, and across three
def test_the_flex_kernel_computes_what_the_explicit_mask_does(family, T):
    """CUDA's kernel (FlexAttention, a block mask per batch) against every device's (SDPA, an explicit mask): the
    same logits within 1e-5, in FlexAttention's eager forward on a CPU (it has no CPU backward)."""
    torch.manual_seed(1)
    net = GPT(GPTConfig(n_layer=2, n_head=2, d_model=32, context_length=T, vocab_size=64, **FAMILIES[family]))
    net.doc_separator = SEP
    ids = torch.randint(1, 64, (3, T))
    ids[torch.rand(3, T) < 0.05] = SEP  # documents of every length, at different places in each row
    ids[0, : min(T, 16)] = WINDOW[0, :T]
    with torch.no_grad():
        masked = net(ids)
        net.doc_kernel = "flex"
        flex = net(ids)
    assert torch.allclose(flex, masked, atol=1e-5, rtol=0), (flex - masked).abs().max()


def test_the_kernel_is_chosen_once_for_the_device():
    net = net_of("llama")
    assert "FlexAttention" in net.choose_doc_kernel("cuda") and net.doc_kernel == "flex"
    line = net.choose_doc_kernel("cpu")
    assert net.doc_kernel == "mask" and line == (
        "data.pack=doc: attention by SDPA with an explicit (B, 1, T, T) mask on cpu (FlexAttention has no backward there)"
    )
    net.cfg.dropout = 0.1
    assert "(FlexAttention has no dropout)" in net.choose_doc_kernel("cuda") and net.doc_kernel == "mask"


def test_without_packing_documents_see_each_other():
    """The check above can fail: unmasked, the last document's losses depend on the ones before it."""
    net = net_of("gpt2")
    net.doc_separator = None
    packed = net(WINDOW)[0, 9:]
    assert not torch.allclose(packed, net(WINDOW[:, 9:])[0], atol=1e-3)


def test_training_with_pack_doc_masks_by_the_shards_end_of_text(make_cfg, caplog):
    with caplog.at_level(logging.INFO, logger="steadylm"):
        metrics, objects = train(make_cfg("data.pack=doc", "trainer.max_steps=6", "trainer.val_check_interval=6"))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data.pack=doc: attention by")]
    assert lines == [
        "data.pack=doc: attention by SDPA with an explicit (B, 1, T, T) mask on cpu (FlexAttention has no backward there)"
    ]
    assert objects["module"].net.doc_kernel == "mask"
    assert objects["module"].net.doc_separator == 256  # bytes: ids 0..255, end-of-text 256
    assert objects["module"].hparams["doc_separator"] == 256
    assert objects["trainer"].global_step == 6 and torch.isfinite(torch.tensor(metrics["val/loss"]))
    _, plain = train(make_cfg("trainer.max_steps=2", "trainer.val_check_interval=2", "optim.warmup_steps=1"))
    assert plain["module"].net.doc_separator is None


@pytest.mark.slow
def test_pack_bench_prints_every_variant_on_both_corpora(tmp_path):
    """benchmarks/pack_bench.py at tiny sizes: a row per corpus and variant, and a paired step ratio per corpus."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root, out = Path(__file__).resolve().parents[1], tmp_path / "pack.json"
    cmd = [sys.executable, str(root / "benchmarks" / "pack_bench.py"), "--steps", "6", "--seeds", "1", "--pairs", "10"]
    cmd += ["--max-bytes", "200000", "--context", "64", "--batch", "4", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    corpora = json.loads(out.read_text())["corpora"]
    assert list(corpora) == ["short files", "embedded corpus"]
    for c in corpora.values():
        assert list(c["rows"]) == ["pack=none", "pack=doc", "align=doc"]
        assert [row["kernel"][0] for row in c["rows"].values()] == ["causal", "mask", "causal"]  # chosen at startup
        assert list(c["kernels"]) == ["mask"] and c["kernels"]["mask"] == c["masked_over_unmasked_step"]  # a CPU
        for row in c["rows"].values():
            assert 0 < row["val_loss"][0] < 6 and 0 < row["per_doc_val_loss"][0] < 6
        assert c["rows"]["align=doc"]["target_share"][0] < 1 == c["rows"]["pack=doc"]["target_share"][0]
        value, low, high = c["masked_over_unmasked_step"]
        assert low <= value <= high
    assert "step time, short files: pack=doc (mask) / pack=none" in proc.stdout and "on a CPU)" in proc.stdout
