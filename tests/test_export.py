"""`python -m steadylm.export`: a real training checkpoint -> a Hugging Face folder whose logits and tokens equal ours."""

from __future__ import annotations

import json

import pytest
import torch

from steadylm.config import compose
from steadylm.errors import ConfigError
from steadylm.export import hf_family, main
from steadylm.generate import load_checkpoint
from steadylm.model import GPT, GPTConfig
from steadylm.train import train

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

TEXT = "def f(x):\n    return x ** 2  # héllo, wörld — 日本語 ✓\n\n\tclass A: pass"
SMALL = [
    "trainer=cpu",
    "model.n_layer=2",
    "model.n_head=4",
    "model.d_model=32",
    "model.context_length=32",
    "data.batch_size=4",
    "trainer.max_steps=3",
    "optim.warmup_steps=1",
    "trainer.val_check_interval=3",
    "data.val_windows=4",
    "trainer.enable_progress_bar=false",
    "callbacks=minimal",
]
FAMILIES = {
    "gpt2": ([], "GPT2LMHeadModel"),
    "gpt2-nobias-untied": (["model.bias=false", "model.tie_embeddings=false"], "GPT2LMHeadModel"),
    "llama": (["model=llama_tiny", "model.n_kv_head=2"], "LlamaForCausalLM"),
    "llama-bias-untied": (
        [
            "model=llama_tiny",
            "model.n_kv_head=1",
            "model.bias=true",
            "model.tie_embeddings=false",
            "model.rope_theta=500000",
        ],
        "LlamaForCausalLM",
    ),
    "llama-qk_norm": (["model=llama_tiny", "model.n_kv_head=2", "model.qk_norm=true"], "Qwen3ForCausalLM"),
    # muP at 2x its base width: the logit and attention factors folded into the exported weights
    "gpt2-mup": (
        ["model.parametrization=mup", "model.mup_base_width=16", "model.mup_base_head_dim=4"],
        "GPT2LMHeadModel",
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def trained(request, shards_dir, tmp_path_factory):
    extra, cls = FAMILIES[request.param]
    out = tmp_path_factory.mktemp(f"export_{request.param}")
    train(compose([*extra, *SMALL, f"data.dir={shards_dir}", f"paths.output_dir={out / 'run'}"]))
    ckpt = out / "run" / "checkpoints" / "last.ckpt"
    main([f"ckpt={ckpt}", f"out={out / 'hf'}"])
    return ckpt, out / "hf", cls


def test_exported_folder_loads_in_transformers_and_logits_equal_ours(trained):
    ckpt, folder, cls = trained
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in folder.iterdir()
    }
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(hf).__name__ == cls
    ours, tok = load_checkpoint(ckpt)
    x = torch.randint(0, ours.cfg.vocab_size, (3, ours.cfg.context_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x), rtol=0, atol=1e-4)
    assert json.loads((folder / "config.json").read_text())["eos_token_id"] == tok.eos_id


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_packed_model_exports_with_a_note_and_scores_one_document_as_training_did(
    family, shards_dir, tmp_path, capsys
):
    """data.pack=doc: each document of a packed window, run alone in transformers after its end-of-text id, gets
    the logits our packed forward gave it (positions restart at the id in both)."""
    extra = FAMILIES[family][0]
    train(compose([*extra, *SMALL, "data.pack=doc", f"data.dir={shards_dir}", f"paths.output_dir={tmp_path / 'run'}"]))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    main([f"ckpt={ckpt}", f"out={tmp_path / 'hf'}"])
    assert (
        "note: trained with data.pack=doc: give the exported model one document per sequence" in capsys.readouterr().err
    )
    ours, tok = load_checkpoint(ckpt)
    assert ours.doc_separator == tok.eos_id == 256
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 256, (1, ours.cfg.context_length), generator=torch.Generator().manual_seed(0))
    x[0, [7, 19]] = tok.eos_id  # three documents: a tail, then two that start at their end-of-text id
    with torch.no_grad():
        packed = ours(x)[0]
        for start, end in ((0, 7), (7, 19), (19, x.shape[1])):
            torch.testing.assert_close(hf(x[:, start:end]).logits[0], packed[start:end], rtol=0, atol=1e-4)
        assert not torch.allclose(hf(x).logits[0, 19:], packed[19:], atol=1e-3)  # packed together: it cannot


def test_exported_tokenizer_encodes_like_ours_and_generates(trained):
    ckpt, folder, _ = trained
    _, tok = load_checkpoint(ckpt)
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf_tok.encode(TEXT, add_special_tokens=False) == tok.encode(TEXT)
    assert hf_tok.eos_token_id == tok.eos_id
    assert hf_tok.decode(tok.encode(TEXT)) == TEXT
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    ids = hf_tok("def ", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 5)


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"qk_norm": True}, "model.qk_norm=true cannot be exported as GPT2LMHeadModel"),
        (
            {"qk_norm": True, "pos": "rope", "norm": "rmsnorm", "mlp": "swiglu"},
            "model.bias=true cannot be exported as Qwen3ForCausalLM",
        ),
        (
            {"qk_norm": True, "pos": "rope", "mlp": "swiglu", "bias": False},
            "model.norm=layernorm cannot be exported as Qwen3ForCausalLM",
        ),
        ({"norm": "rmsnorm"}, "model.norm=rmsnorm cannot be exported as GPT2LMHeadModel"),
        ({"mlp": "swiglu"}, "model.mlp=swiglu cannot be exported as GPT2LMHeadModel"),
        ({"n_kv_head": 2}, "model.n_kv_head=2 cannot be exported as GPT2LMHeadModel"),
        ({"pos": "rope", "mlp": "swiglu"}, "model.norm=layernorm cannot be exported as LlamaForCausalLM"),
        ({"pos": "rope", "norm": "rmsnorm"}, "model.mlp=gelu cannot be exported as LlamaForCausalLM"),
    ],
)
def test_a_switch_the_class_cannot_express_is_refused_naming_it(kw, message):
    with pytest.raises(ConfigError, match=message):
        hf_family(GPTConfig(n_head=4, d_model=32, **kw))


def test_refusal_on_the_command_line_is_one_line_and_exit_2_with_nothing_written(tmp_path, capsys):
    cfg = dict(n_layer=1, n_head=2, d_model=16, context_length=8, vocab_size=320, qk_norm=True)
    net = GPT(GPTConfig(**cfg))
    ckpt = tmp_path / "qk.ckpt"
    torch.save(
        {
            "hyper_parameters": {"model": cfg},
            "steadylm": {"config": {}, "tokenizer": "bytes"},
            "state_dict": {f"net.{k}": v for k, v in net.state_dict().items()},
        },
        ckpt,
    )
    with pytest.raises(SystemExit) as info:
        main([f"ckpt={ckpt}", f"out={tmp_path / 'hf'}"])
    err = capsys.readouterr().err
    assert (
        info.value.code == 2
        and err.count("\n") == 1
        and err.startswith("error: model.qk_norm=true cannot be exported as GPT2LMHeadModel")
    )
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize(
    "argv,expected",
    [
        (["out=x"], "error: ckpt= is required"),
        (["ckpt=/nowhere.ckpt", "out=x"], "error: ckpt=/nowhere.ckpt: checkpoint file not found"),
        (["ckpt=a", "out=b", "fmt=gguf"], "error: fmt is not a config key"),
        (["ckpt=a", "out=b", "overwrite=maybe"], "error: overwrite='maybe' is not allowed; it must be true or false"),
        (
            ["ckpt=/nowhere.ckpt", "out=b", "dtype=int8"],
            "error: dtype='int8' is not allowed; use one of: float32, bfloat16, float16",
        ),
    ],
)
def test_bad_arguments_are_one_line(argv, expected, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2 and capsys.readouterr().err.startswith(expected)


def test_help_lists_the_keys(capsys):
    main(["--help"])
    text = capsys.readouterr().out
    assert all(k in text for k in ("ckpt", "out", "dtype", "overwrite"))


def test_existing_folder_is_not_overwritten_unless_asked(trained, capsys):
    ckpt, folder, _ = trained
    with pytest.raises(SystemExit):
        main([f"ckpt={ckpt}", f"out={folder}"])
    assert "overwrite=true" in capsys.readouterr().err
    main([f"ckpt={ckpt}", f"out={folder}", "overwrite=true", "dtype=bfloat16"])
    assert json.loads((folder / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"


def test_a_bpe_run_exports_its_trained_tokenizer(tmp_path):
    from steadylm.data.prepare import prepare

    prepare(
        input=None,
        out_dir=tmp_path / "data",
        tokenizer="bpe",
        vocab_size=512,
        max_bytes=200_000,
        val_fraction=0.05,
        progress=False,
    )
    train(
        compose(
            [
                "model=llama_tiny",
                "model.vocab_size=512",
                *SMALL,
                f"data.dir={tmp_path / 'data'}",
                "data.tokenizer=bpe",
                f"paths.output_dir={tmp_path / 'run'}",
            ]
        )
    )
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    main([f"ckpt={ckpt}", f"out={tmp_path / 'hf'}"])
    from steadylm.data.tokenizer import load_tokenizer

    ours = load_tokenizer(tmp_path / "data")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert hf_tok.encode(TEXT, add_special_tokens=False) == ours.encode(TEXT)
    assert len(ours.encode(TEXT)) < len(TEXT.encode())  # merges were learned and kept
    assert hf_tok.eos_token_id == ours.eos_id


def test_a_tokenizer_without_a_tokenizer_json_form_writes_nothing(tmp_path):
    from steadylm.export import write_tokenizer

    class Tiktokenish:
        name, eos_id = "gpt2", 50256

    assert write_tokenizer(Tiktokenish(), tmp_path, 1024) is False and not any(tmp_path.iterdir())
