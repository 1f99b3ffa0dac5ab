"""`model.init_from=FOLDER` and `ckpt=FOLDER`: a Hugging Face GPT-2 or Llama folder, made here by `transformers` from
random weights and saved (no download), computes in steadylm what it computes in transformers: the same logits, the
same greedy tokens, and, exported again, the same model. What steadylm cannot represent is refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from steadylm.data.tokenizer import train_bpe
from steadylm.errors import ConfigError
from steadylm.generate import load_checkpoint, sample
from steadylm.model.hf import DEFAULTS, IGNORED, UNREPRESENTED, model_values

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

CONTEXT = 64
LLAMA = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, rms_norm_eps=1e-5)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
FAMILIES = {
    # transformers' GPT-2 default: the tanh GELU (gelu_new), as the published GPT-2
    "gpt2": ("GPT2", dict(n_embd=32, n_layer=2, n_head=4, n_positions=CONTEXT)),
    "gpt2-untied-exact-gelu": (
        "GPT2",
        dict(
            n_embd=32, n_layer=2, n_head=4, n_positions=CONTEXT, activation_function="gelu", tie_word_embeddings=False
        ),
    ),
    "llama-gqa-untied": (
        "Llama",
        dict(**LLAMA, num_key_value_heads=2, max_position_embeddings=CONTEXT, rope_theta=500000.0),
    ),
    # Llama 3's rotary scaling, its original context shorter than ours so that every band of it is used; tied, biased
    "llama3-tied-bias": (
        "Llama",
        dict(
            **LLAMA,
            num_key_value_heads=1,
            max_position_embeddings=CONTEXT,
            rope_theta=500000.0,
            rope_scaling={**LLAMA3, "original_max_position_embeddings": 16},
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
        ),
    ),
}


def tokenizer_json(folder: Path) -> int:
    """A byte-level BPE trained on some Python source, saved as the model's tokenizer.json; its vocabulary size."""
    texts = [Path(m.__file__).read_text() for m in (json, torch.nn.modules.module)]
    tok = train_bpe(texts, vocab_size=384)
    tok.to_hf().save(str(folder / "tokenizer.json"))
    return tok.vocab_size


def make_folder(folder: Path, family: str, shard: bool = False) -> Path:
    """A random `family` model saved by transformers (weights moved off their init, so every tensor counts)."""
    folder.mkdir(parents=True)
    vocab = tokenizer_json(folder)
    kind, kwargs = FAMILIES[family]
    config = getattr(transformers, f"{kind}Config")(vocab_size=vocab, **kwargs)
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}LMHeadModel" if kind == "GPT2" else f"{kind}ForCausalLM")(config)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, **({"max_shard_size": "20KB"} if shard else {}))
    return folder


@pytest.fixture(scope="module", params=list(FAMILIES))
def folder(request, tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("hf") / request.param, request.param, shard="llama3" in request.param)


def hf_logits(folder: Path, x: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(x).logits


def test_imported_logits_equal_transformers(folder):
    ours, _ = load_checkpoint(folder)
    x = torch.randint(0, ours.cfg.vocab_size, (2, CONTEXT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf_logits(folder, x), rtol=0, atol=1e-4)


def test_greedy_generate_continues_as_transformers(folder, capsys):
    from steadylm.generate import main

    ours, tok = load_checkpoint(folder)
    prompt = "def f(x): return"
    ids = tok.encode(prompt)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    theirs = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20, min_new_tokens=20)[0, len(ids) :]
    assert sample(ours, ids, 20, temperature=0, vocab_size=tok.vocab_size) == theirs.tolist()
    main([f"ckpt={folder}", f"prompt='{prompt}'", "temperature=0", "max_new_tokens=20"])
    assert capsys.readouterr().out == prompt + tok.decode(theirs.tolist()) + "\n"


def test_export_of_the_imported_model_round_trips(folder, tmp_path):
    from steadylm.export import main

    main([f"ckpt={folder}", f"out={tmp_path / 'again'}"])
    x = torch.randint(0, 300, (2, CONTEXT), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(hf_logits(tmp_path / "again", x), hf_logits(folder, x), rtol=0, atol=1e-4)
    assert (tmp_path / "again" / "tokenizer.json").is_file()


def test_every_field_of_transformers_configs_has_a_rule_here():
    """Each key of transformers' GPT-2 and Llama configs is mapped, checked or known not to change the function, and
    the defaults this module assumes for a key config.json leaves out are transformers' own: a new transformers
    that adds a field, or changes a default, fails here instead of being silently ignored."""
    base = set(transformers.PretrainedConfig().to_dict())
    for family, cls in (("gpt2", transformers.GPT2Config), ("llama", transformers.LlamaConfig)):
        theirs = cls().to_dict()
        ruled = set(DEFAULTS[family]) | IGNORED | {"rope_parameters"}
        assert set(theirs) - base - ruled == set(), family
        for key, value in DEFAULTS[family].items():  # None: follows other keys (n_head, 4·d), as transformers'
            got = theirs.get(key, (theirs.get("rope_parameters") or {}).get(key))
            assert got == value or value is None, (family, key)
    assert "tie_word_embeddings" in DEFAULTS["llama"] and set(UNREPRESENTED).isdisjoint(IGNORED)


def write_config(tmp_path: Path, **changes) -> Path:
    folder = tmp_path / "m"
    folder.mkdir(exist_ok=True)
    config = {"model_type": "llama", "hidden_size": 32, "num_attention_heads": 4, "vocab_size": 320} | changes
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return folder


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"model_type": "mistral"}, r'model_type="mistral", not gpt2 or llama'),
        ({"hidden_act": "gelu"}, r'hidden_act="gelu", which steadylm cannot represent \(it has silu\)'),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, r'rope_scaling.rope_type="yarn", which steadylm cannot'),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, r'rope_parameters.rope_type="dynamic"'),
        (
            {"layer_types": ["full_attention", "sliding_attention"]},
            r"layer_types=\[.*\], which steadylm's llama cannot",
        ),
        ({"mlp_bias": True}, r"mlp_bias=true, unlike attention_bias=false: steadylm's model.bias sets both"),
        ({"head_dim": 16}, r"head_dim=16, not hidden_size / num_attention_heads"),
        ({"model_type": "gpt2", "activation_function": "relu"}, r'activation_function="relu", which steadylm cannot'),
        ({"model_type": "gpt2", "scale_attn_by_inverse_layer_idx": True}, r"scale_attn_by_inverse_layer_idx=true"),
    ],
)
def test_what_steadylm_cannot_represent_is_refused_naming_the_field(tmp_path, changes, message):
    with pytest.raises(ConfigError, match=r"model.init_from=.*: config.json has " + message):
        model_values(write_config(tmp_path, **changes))


def test_the_config_of_each_family_becomes_our_switches(tmp_path):
    gpt2 = model_values(write_config(tmp_path, model_type="gpt2", n_embd=48, n_head=4, n_positions=256))
    assert {k: gpt2[k] for k in ("pos", "norm", "mlp", "bias", "d_model", "context_length", "tie_embeddings")} == {
        "pos": "learned", "norm": "layernorm", "mlp": "gelu_tanh", "bias": True, "d_model": 48, "context_length": 256,
        "tie_embeddings": True,
    }  # fmt: skip
    old_style = {"rope_theta": 5e5, "rope_scaling": {"type": "llama3", **LLAMA3, "original_max_position_embeddings": 8}}
    llama = model_values(write_config(tmp_path, num_key_value_heads=2, **old_style))  # transformers 4's keys
    assert llama["rope_theta"] == 5e5 and llama["n_kv_head"] == 2 and llama["context_length"] == 2048
    assert llama["rope_scaling"] == {**LLAMA3, "original_max_position_embeddings": 8}
    assert (llama["pos"], llama["norm"], llama["mlp"], llama["bias"], llama["tie_embeddings"]) == (
        "rope", "rmsnorm", "swiglu", False, False,
    )  # fmt: skip


def test_a_folder_that_is_not_one_is_refused_in_one_line(tmp_path):
    (tmp_path / "last.ckpt").write_bytes(b"x")
    with pytest.raises(ConfigError, match=r"is a file; it takes a Hugging Face folder .* init_from=<file.ckpt>"):
        model_values(tmp_path / "last.ckpt")
    with pytest.raises(ConfigError, match=r"no config.json there"):
        model_values(tmp_path)


@pytest.mark.parametrize(
    "kw, message",
    [
        (
            {"rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8}},
            r"rope_scaling is set but model.pos=learned",
        ),
        ({"pos": "rope", "rope_scaling": {"rope_type": "yarn", "factor": 4}}, r"must be null or Llama 3's"),
        (
            {"pos": "rope", "rope_scaling": LLAMA3},
            r"rope_scaling.original_max_position_embeddings=None must be a number",
        ),
        (
            {"pos": "rope", "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8, "beta": 1}},
            r"\.beta is not",
        ),
        (
            {"init_from": "m", "parametrization": "mup"},
            r"model.parametrization=mup cannot start from model.init_from=m",
        ),
    ],
)
def test_the_new_fields_refuse_a_bad_value_in_one_line(kw, message):
    from steadylm.model import GPTConfig

    with pytest.raises(ConfigError, match=message):
        GPTConfig(**kw)
