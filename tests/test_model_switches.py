"""The architecture switches (`model.pos/norm/mlp/n_kv_head/tie_embeddings/bias`): each one, every
combination, the config refusals, the presets' sizes, and the stability suite on the Llama family."""

from __future__ import annotations

import itertools
import math
import re

import pytest
import torch
import torch.nn.functional as F

from steadylm.config import compose
from steadylm.errors import ConfigError
from steadylm.model import GPT, GPTConfig
from steadylm.model.gpt import apply_rope, rope_tables

V, T = 64, 16
SWITCHES = list(
    itertools.product(
        ("learned", "rope"),
        ("layernorm", "rmsnorm"),
        ("gelu", "swiglu"),
        (None, 2),
        (True, False),
        (True, False),
        (False, True),
    )
)


def small(**kw) -> GPT:
    torch.manual_seed(0)
    base = dict(n_layer=2, n_head=4, d_model=32, context_length=T, vocab_size=V)
    return GPT(GPTConfig(**{**base, **kw}))


@pytest.mark.parametrize("pos,norm_,mlp,kv,tie,bias,qk", SWITCHES, ids=["-".join(map(str, s)) for s in SWITCHES])
def test_every_combination_is_causal_and_learns(pos, norm_, mlp, kv, tie, bias, qk):
    model = small(pos=pos, norm=norm_, mlp=mlp, n_kv_head=kv, tie_embeddings=tie, bias=bias, qk_norm=qk)
    x = torch.randint(0, V, (4, T), generator=torch.Generator().manual_seed(1))
    y = x.clone()
    y[:, 10:] = (y[:, 10:] + 1) % V
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])
    assert (model.lm_head.weight is model.wte.weight) == tie
    assert any(n.endswith(".bias") for n, _ in model.named_parameters()) == bias

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):  # memorise one batch: loss must fall from ~ln(V)
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(V)) < 0.3
    assert losses[-1] < losses[0] - 0.5, losses


def test_switch_shapes():
    llama = small(pos="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, bias=False, tie_embeddings=False)
    assert llama.wpe is None and "rope_cos" not in llama.state_dict()  # tables are rebuilt, never stored
    attn = llama.blocks[0].attn
    assert attn.qkv.weight.shape == ((4 + 2 * 2) * 8, 32)  # 4 query heads, 2 key and 2 value heads of 8
    assert isinstance(llama.blocks[0].ln_1, torch.nn.RMSNorm) and llama.blocks[0].mlp.fc.bias is None
    assert llama.blocks[0].mlp.fc.weight.shape == (2 * 85, 32)  # gate and up fused, int(8/3 · 32) = 85 each
    gpt = small()
    assert isinstance(gpt.blocks[0].ln_1, torch.nn.LayerNorm) and gpt.blocks[0].mlp.fc.weight.shape == (128, 32)


def test_mlp_hidden_size_rounds_up_to_the_stated_multiple():
    assert GPTConfig(d_model=128, mlp="swiglu").hidden == 341  # int(8/3 · 128)
    assert GPTConfig(d_model=128, mlp="swiglu", mlp_multiple_of=64).hidden == 384
    assert GPTConfig(d_model=2048, n_head=32, mlp="swiglu", mlp_hidden=8192, mlp_multiple_of=256).hidden == 8192
    assert GPTConfig(d_model=128, mlp_hidden=300, mlp_multiple_of=128).hidden == 384
    assert GPTConfig(d_model=128).hidden == 512


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"n_kv_head": 3}, "model.n_kv_head=3 does not divide model.n_head=4"),
        ({"n_kv_head": 0}, "model.n_kv_head=0 must be a whole number > 0"),
        ({"pos": "alibi"}, "model.pos='alibi' is not allowed; use one of: learned, rope"),
        ({"norm": "batchnorm"}, "model.norm='batchnorm' is not allowed; use one of: layernorm, rmsnorm"),
        ({"mlp": "relu"}, "model.mlp='relu' is not allowed; use one of: gelu, gelu_tanh, swiglu"),
        ({"init": "he"}, "model.init='he' is not allowed"),
        ({"d_model": 30}, "model.d_model=30 is not divisible by model.n_head=4"),
        ({"n_layer": 0}, "model.n_layer=0 must be a whole number > 0"),
        ({"vocab_size": -1}, "model.vocab_size=-1 must be a whole number > 0"),
        ({"context_length": 0}, "model.context_length=0 must be a whole number > 0"),
        ({"mlp_hidden": 0}, "model.mlp_hidden=0 must be a whole number > 0"),
        ({"pos": "rope", "d_model": 36, "n_head": 4}, "model.pos=rope needs an even head size"),
        ({"pos": "rope", "rope_theta": 0.0}, "model.rope_theta=0.0 must be > 0"),
        ({"dropout": 1.0}, "model.dropout=1.0 must be in"),
    ],
)
def test_bad_model_config_is_one_config_error_naming_key_value_and_fix(kw, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        GPTConfig(**{"n_head": 4, "d_model": 32, **kw})


def test_grouped_query_attention_equals_full_attention_with_each_kv_head_repeated_over_its_group():
    gqa = small(n_kv_head=2, pos="rope")
    mha = small(n_kv_head=4, pos="rope")
    sd = gqa.state_dict()
    D, H, KV = 8, 4, 2
    for i in range(2):
        w = sd[f"blocks.{i}.attn.qkv.weight"]
        q, k, v = w.split([H * D, KV * D, KV * D])
        rep = lambda t: t.view(KV, D, -1).repeat_interleave(H // KV, dim=0).reshape(H * D, -1)  # noqa: E731
        sd[f"blocks.{i}.attn.qkv.weight"] = torch.cat([q, rep(k), rep(v)])
        b = sd[f"blocks.{i}.attn.qkv.bias"]
        qb, kb, vb = b.split([H * D, KV * D, KV * D])
        sd[f"blocks.{i}.attn.qkv.bias"] = torch.cat(
            [qb, kb.view(KV, D).repeat_interleave(2, 0).flatten(), vb.view(KV, D).repeat_interleave(2, 0).flatten()]
        )
    mha.load_state_dict(sd)
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        torch.testing.assert_close(gqa(x), mha(x), rtol=1e-5, atol=1e-5)
    assert gqa.num_params() < mha.num_params()


def test_rope_scores_depend_only_on_the_distance_between_positions():
    cos, sin = rope_tables(8, 64, 10000.0)
    q, k = torch.randn(8), torch.randn(8)

    def score(i, j):
        qi = apply_rope(q.view(1, 1, 1, 8), cos[i : i + 1], sin[i : i + 1]).flatten()
        kj = apply_rope(k.view(1, 1, 1, 8), cos[j : j + 1], sin[j : j + 1]).flatten()
        return float(qi @ kj)

    assert score(5, 2) == pytest.approx(score(40, 37), rel=1e-4)
    assert score(5, 2) != pytest.approx(score(5, 4), rel=1e-3)
    torch.testing.assert_close(apply_rope(q.view(1, 1, 1, 8), cos[:1], sin[:1]).flatten(), q)  # position 0: identity


def test_rope_model_accepts_no_more_than_its_context():
    with pytest.raises(ValueError, match="model.context_length=16"):
        small(pos="rope")(torch.zeros(1, 17, dtype=torch.long))


@pytest.mark.parametrize(
    "preset,total,non_embedding",
    [
        ("tiny", 454_144, 437_760),
        ("small", 124_475_904, 123_689_472),  # GPT-2 124M (vocab padded to 50304)
        ("llama_tiny", 434_816, 434_816),
        ("llama_small", 123_587_328, 123_587_328),
        ("llama_1b", 1_235_814_400, 1_235_814_400),  # Llama-3.2-1B: 1.24B
    ],
)
def test_preset_parameter_counts(preset, total, non_embedding):
    from omegaconf import OmegaConf

    # The CPU presets take their vocabulary from the shards: here the bytes tokenizer's, padded (320).
    model = compose([f"model={preset}"]).model
    cfg = GPTConfig(**{**OmegaConf.to_container(model, resolve=True), "vocab_size": model.vocab_size or 320})
    with torch.device("meta"):  # shapes only: the 1B model allocates nothing
        net = GPT(cfg)
    assert net.num_params(non_embedding=False) == total
    assert net.num_params() == non_embedding
    assert net.flops_per_token() == 6 * non_embedding + 12 * cfg.n_layer * cfg.d_model * cfg.context_length


def test_untied_head_counts_in_the_6n_rule_and_the_token_table_does_not():
    tied, untied = small(), small(tie_embeddings=False)
    assert untied.num_params(non_embedding=False) == tied.num_params(non_embedding=False) + V * 32
    assert untied.num_params() == tied.num_params() + V * 32 - V * 32  # lm_head in, wte out
    assert untied.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.2)


@pytest.mark.parametrize(
    "kw",
    [
        {},
        dict(pos="rope", norm="rmsnorm", mlp="swiglu", n_kv_head=2, bias=False),
        dict(pos="rope", mlp="swiglu", tie_embeddings=False),
    ],
)
def test_flops_per_token_matches_a_flop_counter(kw):
    from torch.utils.flop_counter import FlopCounterMode

    model = small(d_model=64, **kw)  # the attention term (not counted on CPU) stays a few % of 6N
    B = 2
    x = torch.randint(0, V, (B, T))
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    assert counter.get_total_flops() / (B * T) == pytest.approx(model.flops_per_token(), rel=0.1)


LLAMA = ["model=llama_tiny", "model.n_kv_head=1"]  # FAST's n_head=2 (conftest): one key/value head for both


def test_stability_suite_on_the_llama_family_with_qk_norm_z_loss_and_xavier_init(make_cfg, tmp_path):
    """Per-block stats equal a brute-force computation; the attention-logit monitor reads every block."""
    from tests.helpers import FAST, STEP, Truth, fit, norm, scalars

    truth = Truth()
    fit(make_cfg(*LLAMA, *FAST, "optim.lr=1e-2", "model.qk_norm=true", "optim.z_loss=1e-4", "model.init=xavier"), truth)
    tags = scalars(tmp_path / "run")
    at = lambda tag: tags[tag][1]  # noqa: E731
    names = list(truth.before)
    for i in range(2):
        own = [n for n in names if n.startswith(f"blocks.{i}.")]
        assert at(f"stability/grad_norm/block_{i}") == pytest.approx(norm(truth.grads[n] for n in own), rel=1e-5)
        assert at(f"stability/act_rms/block_{i}") == pytest.approx(truth.rms[i], rel=1e-5)
        assert 0 < at(f"stability/max_attn_logit/block_{i}") < 100
    assert "train/z_loss" in tags and STEP == 7


def test_first_non_finite_module_is_named_in_the_llama_family(make_cfg, tmp_path):
    from steadylm.stability import read_events
    from tests.helpers import FAST, faults, fit

    cfg = make_cfg(
        *LLAMA,
        *FAST,
        "callbacks.stability.guard.max_consecutive=2",
        "callbacks.stability.guard.action=stop",
        faults({"kind": "nan_weight", "step": 5, "param": "blocks.1.mlp.fc.weight"}),
    )
    fit(cfg)
    events = read_events(tmp_path / "run")
    named = [e for e in events if e["detail"].get("module")]
    assert named and all(e["detail"]["module"] == "blocks.1.mlp.fc" for e in named)
    assert events[-1]["kind"] == "stop"


@pytest.mark.parametrize(
    "switch",
    [
        "model.pos=rope",
        "model.norm=rmsnorm",
        "model.mlp=swiglu",
        "model.n_kv_head=1",
        "model.tie_embeddings=false",
        "model.bias=false",
    ],
)
def test_each_switch_trains_under_the_full_suite_with_qk_norm_z_loss_and_xavier(make_cfg, tmp_path, switch):
    """The real Trainer, default callbacks: every per-block stat and the attention-logit monitor reported."""
    from tests.helpers import FAST, fit, scalars

    objs = fit(make_cfg(*FAST, switch, "model.qk_norm=true", "optim.z_loss=1e-4", "model.init=xavier"))
    assert objs["trainer"].global_step == 12 and objs["module"].skipped_steps == 0
    tags = scalars(tmp_path / "run")
    assert all(math.isfinite(v) for v in tags["train/loss"]) and "train/z_loss" in tags
    for i in range(2):
        for stat in ("grad_norm", "param_norm", "update_ratio", "act_rms", "max_attn_logit"):
            values = tags[f"stability/{stat}/block_{i}"]
            positive = stat != "max_attn_logit"  # a head's largest logit may be below 0 (qk-norm, early on)
            assert values and all(math.isfinite(v) and (v > 0 or not positive) for v in values), (stat, i, values)


# The speedrun switch kept (modded-nanogpt, nanochat): logit_softcap.
SPEEDRUN = dict(logit_softcap=15.0)


def test_logit_softcap_bounds_the_logits_of_generation_and_both_loss_paths():
    from steadylm.module import LMModule

    model = small(logit_softcap=2.0)
    with torch.no_grad():
        model.lm_head.weight.mul_(500)  # raw logits in the tens
    x = torch.randint(0, V, (2, T))
    with torch.no_grad():
        raw = model.lm_head(model(x, head=False))
        assert raw.abs().max() > 20
        torch.testing.assert_close(model(x), 2.0 * torch.tanh(raw / 2.0))
        assert model(x).abs().max() <= 2.0
    # z-loss is log Z of the capped logits, by either path
    y = torch.randint(0, V, (2, T))
    cfg = dict(n_layer=1, n_head=4, d_model=32, context_length=T, vocab_size=V, logit_softcap=2.0)
    plain, chunked = (LMModule(model=cfg, optim=dict(lr=1e-3, z_loss=0.1, loss=p)) for p in ("plain", "chunked"))
    with torch.no_grad():
        plain.net.lm_head.weight.mul_(50)  # logits of a few units: the cap bends them
    chunked.load_state_dict(plain.state_dict())
    with torch.no_grad():
        z = plain(x).logsumexp(-1).square().mean().item() * 0.1
        uncapped = plain.net.lm_head(plain.net(x, head=False)).logsumexp(-1).square().mean().item() * 0.1
        assert z < uncapped - 0.1
        for module in (plain, chunked):
            assert module.head_loss(x, y)[1].item() == pytest.approx(z, abs=1e-6)


def test_switches_off_keep_every_checkpoint_name():
    names = set(small().state_dict())
    assert set(small(logit_softcap=30.0).state_dict()) == names


@pytest.mark.parametrize("key,value", [*SPEEDRUN.items()])
def test_export_refuses_each_speedrun_switch_in_one_line(key, value):
    from steadylm.export import hf_family

    with pytest.raises(ConfigError, match=f"^model.{key}=") as err:
        hf_family(GPTConfig(n_head=4, d_model=32, **{key: value}))
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"mlp": "relu3"}, "model.mlp='relu3' is not allowed; use one of: gelu, gelu_tanh, swiglu"),
        ({"logit_softcap": 0}, "model.logit_softcap=0 must be a number > 0 (e.g. 15), or null"),
        ({"logit_softcap": "big"}, "model.logit_softcap='big' must be a number > 0"),
        ({"qk_norm": "yes"}, "model.qk_norm='yes' must be true or false"),
    ],
)
def test_bad_speedrun_value_is_one_config_error(kw, message):
    with pytest.raises(ConfigError, match="^" + re.escape(message)) as err:
        GPTConfig(**{"n_layer": 2, "n_head": 4, "d_model": 32, **kw})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "family",
    [[], ["model=llama_tiny", "model.n_kv_head=1", "optim=muon", "model.tie_embeddings=false"]],
    ids=["gpt2-adamw", "llama-muon"],
)
def test_all_speedrun_switches_train_finite_under_the_full_suite(make_cfg, tmp_path, family):
    """The real Trainer and stability suite with QK-norm and z-loss: finite losses and per-block stats."""
    from tests.helpers import FAST, fit, scalars

    switches = [f"model.{k}={str(v).lower()}" for k, v in SPEEDRUN.items()]
    objs = fit(make_cfg(*family, *FAST, *switches, "model.qk_norm=true", "optim.z_loss=1e-4"))
    assert objs["trainer"].global_step == 12 and objs["module"].skipped_steps == 0
    tags = scalars(tmp_path / "run")
    assert all(math.isfinite(v) for v in tags["train/loss"]) and tags["train/loss"][-1] < tags["train/loss"][0]
    for i in range(2):
        for stat in ("grad_norm", "param_norm", "update_ratio", "act_rms", "max_attn_logit"):
            assert all(math.isfinite(v) for v in tags[f"stability/{stat}/block_{i}"]), (stat, i)
