"""Export a training checkpoint as a Hugging Face folder: `python -m steadylm.export ckpt=PATH out=DIR`.

The folder loads with `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and
`AutoTokenizer.from_pretrained(DIR)`, no custom code: `config.json`, `model.safetensors`,
`generation_config.json`, `tokenizer.json` (+ `tokenizer_config.json`).

The family follows `model.pos`: learned positions -> `GPT2LMHeadModel`, rotary -> `LlamaForCausalLM`,
or `Qwen3ForCausalLM` with `model.qk_norm=true` (Qwen3 is Llama plus RMSNorm on each q/k head).
A switch the chosen class cannot express is refused in one line naming it (exit 2), never approximated:
GPT-2 has LayerNorm, a GELU MLP, one k/v head per query head and no QK-norm; Llama and Qwen3 have RMSNorm
and SwiGLU; Qwen3 has no MLP biases. What each class does express is mapped exactly: `bias=false` into
GPT-2 as zero biases, untied embeddings as `tie_word_embeddings=false`, grouped k/v heads and biases
(`attention_bias`, `mlp_bias`) into Llama, and `model.parametrization=mup` folded into the weights (its
logit factor into the final norm, its attention factor into the queries: `sp_state_dict`). The names, ours and
theirs, are model/hf.py's, which `model.init_from` reads the other way; `ckpt=` may be such a folder itself. Our
checkpoint stays the source of truth (as litgpt's does); this is the only module that imports `transformers`, and a
test holds the exported logits equal to ours.
A model trained with `data.pack=doc` is exported as it is, with a note: a Hugging Face model given one document per
sequence (after its end-of-text id, or none) computes what training did, and only documents packed into one sequence,
which it cannot mask apart, would differ.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from steadylm.data.tokenizer import tokenizer_of_run
from steadylm.errors import ConfigError, SteadyError
from steadylm.generate import load_model
from steadylm.model import GPT, GPTConfig, mup
from steadylm.model.hf import CLASSES, CONFIG_NAMES, GELU, family_of, to_hf
from steadylm.model.switches import require_understood

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ExportArgs:
    """The command's keys; their defaults and help live in conf/export.yaml."""

    ckpt: str
    out: str
    dtype: str = "float32"
    overwrite: bool = False


# --- which Hugging Face class --------------------------------------------------------------------


def hf_family(cfg: GPTConfig) -> str:
    """`gpt2`, `llama` or `qwen3`; ConfigError naming the first switch the class cannot express."""
    require_understood(cfg, "export")  # a switch export was never taught: refused, not dropped
    if cfg.qk_norm and cfg.pos == "learned":
        raise ConfigError(
            "model.qk_norm=true cannot be exported as GPT2LMHeadModel (model.pos=learned picks GPT-2, which does not "
            "normalise queries and keys); with the Llama switches (model.pos=rope model.norm=rmsnorm model.mlp=swiglu "
            "model.bias=false) it exports as Qwen3ForCausalLM"
        )
    family = family_of(cfg)
    cls = CLASSES[family]
    if family == "gpt2":
        need = {"norm": (("layernorm",), "LayerNorm"), "mlp": (("gelu", "gelu_tanh"), "a GELU MLP")}
        if cfg.n_kv_head != cfg.n_head:
            raise ConfigError(
                f"model.n_kv_head={cfg.n_kv_head} cannot be exported as GPT2LMHeadModel (model.pos=learned picks "
                f"GPT-2, which has one key/value head per query head); use model.n_kv_head=null, or the Llama "
                "switches model.pos=rope model.norm=rmsnorm model.mlp=swiglu"
            )
    else:  # Qwen3 is Llama plus an RMSNorm on each query and key head, applied before the rotation, as ours is.
        need = {"norm": (("rmsnorm",), "RMSNorm"), "mlp": (("swiglu",), "a SwiGLU MLP")}
        need |= {"bias": ((False,), "no MLP biases")} if family == "qwen3" else {}
    for key, (values, what) in need.items():
        if getattr(cfg, key) not in values:
            picked = f"model.pos={cfg.pos}" + (" model.qk_norm=true" if family == "qwen3" else "")
            show = lambda v: str(v).lower() if isinstance(v, bool) else v  # noqa: E731
            raise ConfigError(
                f"model.{key}={show(getattr(cfg, key))} cannot be exported as {cls} ({picked} picks it, and it "
                f"has {what} only); train with model.{key}={show(values[0])}, or "
                + ("model.pos=learned for GPT-2" if family == "gpt2" else "model.pos=rope for Llama")
                + " with its other switches"
            )
    return family


def sp_state_dict(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights of an sp model (1/sqrt(d_head) attention, no logit factor) computing the same function:
    Hugging Face's GPT-2 and Llama have neither muP multiplier. The logit factor
    goes into the final norm's gain and bias (ln_f is linear in them; the tied embedding cannot carry it
    without changing the input). The attention factor c = sqrt(b / d_head) goes into the queries: the q
    rows of `qkv` (rotary positions are linear, so they commute), or the q_norm gain when QK-norm would
    undo a scaled projection. Under sp (or mup at the base shape) it is `net.state_dict()` unchanged.
    """
    cfg = net.cfg
    sd = dict(net.state_dict())
    scale, mult = mup.attn_scale(cfg), mup.logit_mult(cfg)
    if mult != 1.0:
        for key in ("ln_f.weight", "ln_f.bias"):
            if key in sd:
                sd[key] = sd[key] * mult
    if scale is None or scale == 1.0 / math.sqrt(cfg.head_dim):
        return sd
    c = scale * math.sqrt(cfg.head_dim)
    q_rows = cfg.n_head * cfg.head_dim
    for i in range(cfg.n_layer):
        p = f"blocks.{i}.attn."
        keys = (p + "q_norm.weight", p + "q_norm.bias") if cfg.qk_norm else (p + "qkv.weight", p + "qkv.bias")
        for key in keys:
            if key not in sd:
                continue
            t = sd[key].clone()
            if cfg.qk_norm:
                t *= c
            else:
                t[:q_rows] *= c
            sd[key] = t
    return sd


def hf_config(c: GPTConfig, family: str) -> dict:
    """The `family` config's kwargs for `c`: the names model/hf.py maps, and what each class needs besides."""
    config = {
        theirs: getattr(c, ours) for ours, theirs in CONFIG_NAMES["gpt2" if family == "gpt2" else "llama"].items()
    }
    if family == "gpt2":
        config["n_inner"] = c.hidden
        config.pop("tie_word_embeddings")  # added below for every family
        act = next(theirs for theirs, ours in GELU.items() if ours == c.mlp)  # gelu_tanh: gelu_new, GPT-2's own
        return config | {"activation_function": act, "resid_pdrop": c.dropout, "embd_pdrop": c.dropout,
                         "attn_pdrop": c.dropout, "tie_word_embeddings": c.tie_embeddings}  # fmt: skip
    config |= {"intermediate_size": c.hidden, "rope_theta": float(c.rope_theta), "head_dim": c.head_dim}
    config |= {"hidden_act": "silu", "attention_dropout": c.dropout}
    if c.rope_scaling is not None:
        config["rope_scaling"] = dict(c.rope_scaling)
    if family == "qwen3":
        return config | {"use_sliding_window": False}
    return config | {"mlp_bias": c.bias}


# --- the folder ------------------------------------------------------------------------------------


def _transformers():
    try:
        import transformers
    except ImportError:
        raise SteadyError(
            "export needs the transformers and safetensors packages: pip install 'steadylm[export]' "
            "(or pip install transformers safetensors)"
        ) from None
    return transformers


def to_hf_model(net: GPT, eos_id: int | None = None, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The equivalent `transformers` model (GPT2LMHeadModel or LlamaForCausalLM), weights copied."""
    tf = _transformers()
    family = hf_family(net.cfg)
    kwargs, state = hf_config(net.cfg, family), to_hf(sp_state_dict(net), net.cfg, family)  # muP folded in
    # One end-of-text id serves as bos, eos and pad (GPT-2's convention): `generate` needs no pad warning.
    ids = {"bos_token_id": eos_id, "eos_token_id": eos_id, "pad_token_id": eos_id} if eos_id is not None else {}
    names = {
        "gpt2": ("GPT2Config", "GPT2LMHeadModel"),
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    }[family]
    if not hasattr(tf, names[1]):
        raise SteadyError(
            f"{names[1]} needs a newer transformers (installed: {tf.__version__}); pip install -U transformers"
        )
    config = getattr(tf, names[0])(**kwargs, **ids)
    model = getattr(tf, names[1])(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if net.cfg.tie_embeddings else set()
    if set(missing) - tied or unexpected:  # the mapping above is complete; anything else is a bug here
        raise RuntimeError(f"export mapping incomplete: missing {missing}, unexpected {unexpected}")
    if net.cfg.tie_embeddings:
        model.tie_weights()
    return model.to(dtype).eval()


def write_tokenizer(tok, out: Path, context_length: int) -> bool:
    """`tokenizer.json` + `tokenizer_config.json` for `AutoTokenizer`; False when `tok` has no such form (tiktoken)."""
    to_hf = getattr(tok, "to_hf", None)
    if to_hf is None:
        return False
    hf = to_hf()
    hf.save(str(out / "tokenizer.json"))
    eos = hf.id_to_token(tok.eos_id)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",  # the generic fast tokenizer: tokenizer.json is the whole spec
        "bos_token": eos,
        "pad_token": eos,
        "eos_token": eos,
        "model_max_length": context_length,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return True


def export(args: ExportArgs) -> Path:
    if args.dtype not in DTYPES:
        raise SteadyError(f"dtype={args.dtype!r} is not allowed; use one of: {', '.join(DTYPES)}")
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.overwrite:
        raise SteadyError(
            f"out={out} already exists and is not an empty folder; choose another, or pass overwrite=true"
        )
    net, meta = load_model(args.ckpt)
    hf_family(net.cfg)  # refuse before any work or any file
    tok = tokenizer_of_run(meta)  # the run's tokenizer.json in its data.dir, the bytes tokenizer included
    model = to_hf_model(net, eos_id=tok.eos_id, dtype=DTYPES[args.dtype])
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)  # config.json, model.safetensors, generation_config.json
    if net.doc_separator is not None:
        print(
            "note: trained with data.pack=doc: give the exported model one document per sequence (after its "
            "end-of-text id); it cannot mask documents packed into one sequence apart",
            file=sys.stderr,
        )
    if not write_tokenizer(tok, out, net.cfg.context_length):
        hub = " (the Hub's openai-community/gpt2 tokenizer gives the same ids)" if tok.name == "gpt2" else ""
        print(
            f"note: no tokenizer written: tiktoken's {tok.name!r} has no tokenizer.json form here{hub}", file=sys.stderr
        )
    return out


# --- command line ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """`python -m steadylm.export ckpt=PATH out=DIR [dtype=...] [overwrite=true]` (keys: conf/export.yaml)."""
    from steadylm.cli import run_command

    def task(cfg) -> None:
        out = export(ExportArgs(**{f.name: cfg[f.name] for f in fields(ExportArgs)}))
        print(f"exported to {out}: AutoModelForCausalLM.from_pretrained({str(out)!r})")

    run_command("export", __doc__.split("\n\n")[0], task, argv)


if __name__ == "__main__":
    main()
