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
logit factor into the final norm, its attention factor into the queries: `sp_state_dict`). Our checkpoint stays
the source of truth (as litgpt's does); this is the only module that imports `transformers`, and a test holds the exported logits equal to ours.
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
    if cfg.pos == "learned":
        need = {"norm": ("layernorm", "LayerNorm"), "mlp": ("gelu", "a GELU MLP")}
        cls, family = "GPT2LMHeadModel", "gpt2"
        if cfg.n_kv_head != cfg.n_head:
            raise ConfigError(
                f"model.n_kv_head={cfg.n_kv_head} cannot be exported as GPT2LMHeadModel (model.pos=learned picks "
                f"GPT-2, which has one key/value head per query head); use model.n_kv_head=null, or the Llama "
                "switches model.pos=rope model.norm=rmsnorm model.mlp=swiglu"
            )
    elif cfg.qk_norm:
        # Qwen3 is Llama plus an RMSNorm on each query and key head, applied before the rotation, as ours is.
        need = {"norm": ("rmsnorm", "RMSNorm"), "mlp": ("swiglu", "a SwiGLU MLP"), "bias": (False, "no MLP biases")}
        cls, family = "Qwen3ForCausalLM", "qwen3"
    else:
        need = {"norm": ("rmsnorm", "RMSNorm"), "mlp": ("swiglu", "a SwiGLU MLP")}
        cls, family = "LlamaForCausalLM", "llama"
    for key, (value, what) in need.items():
        if getattr(cfg, key) != value:
            picked = f"model.pos={cfg.pos}" + (" model.qk_norm=true" if family == "qwen3" else "")
            show = lambda v: str(v).lower() if isinstance(v, bool) else v  # noqa: E731
            raise ConfigError(
                f"model.{key}={show(getattr(cfg, key))} cannot be exported as {cls} ({picked} picks it, and it "
                f"has {what} only); train with model.{key}={show(value)}, or "
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


def _t(w: torch.Tensor) -> torch.Tensor:
    """GPT-2's `Conv1D` stores a linear's weight transposed (in, out)."""
    return w.t().contiguous()


def gpt2_state(net: GPT) -> tuple[dict, dict]:
    """(GPT2Config kwargs, GPT2LMHeadModel state_dict). `bias=false` becomes zero biases."""
    c = net.cfg
    sd = sp_state_dict(net)  # muP's multipliers folded in: neither class has them
    zeros = lambda n: torch.zeros(n, dtype=sd["wte.weight"].dtype)  # noqa: E731
    bias = lambda key, n: sd.get(key, zeros(n))  # noqa: E731
    out = {"transformer.wte.weight": sd["wte.weight"], "transformer.wpe.weight": sd["wpe.weight"]}
    for i in range(c.n_layer):
        p, h = f"blocks.{i}.", f"transformer.h.{i}."
        out.update(
            {
                h + "ln_1.weight": sd[p + "ln_1.weight"],
                h + "ln_1.bias": bias(p + "ln_1.bias", c.d_model),
                h + "attn.c_attn.weight": _t(sd[p + "attn.qkv.weight"]),
                h + "attn.c_attn.bias": bias(p + "attn.qkv.bias", 3 * c.d_model),
                h + "attn.c_proj.weight": _t(sd[p + "attn.proj.weight"]),
                h + "attn.c_proj.bias": bias(p + "attn.proj.bias", c.d_model),
                h + "ln_2.weight": sd[p + "ln_2.weight"],
                h + "ln_2.bias": bias(p + "ln_2.bias", c.d_model),
                h + "mlp.c_fc.weight": _t(sd[p + "mlp.fc.weight"]),
                h + "mlp.c_fc.bias": bias(p + "mlp.fc.bias", c.hidden),
                h + "mlp.c_proj.weight": _t(sd[p + "mlp.proj.weight"]),
                h + "mlp.c_proj.bias": bias(p + "mlp.proj.bias", c.d_model),
            }
        )
    out["transformer.ln_f.weight"] = sd["ln_f.weight"]
    out["transformer.ln_f.bias"] = bias("ln_f.bias", c.d_model)
    out["lm_head.weight"] = sd["lm_head.weight"]
    config = dict(
        vocab_size=c.vocab_size,
        n_positions=c.context_length,
        n_embd=c.d_model,
        n_layer=c.n_layer,
        n_head=c.n_head,
        n_inner=c.hidden,
        activation_function="gelu",  # = F.gelu (exact); "gelu_new" is the tanh form
        resid_pdrop=c.dropout,
        embd_pdrop=c.dropout,
        attn_pdrop=c.dropout,
        layer_norm_epsilon=c.norm_eps,
        tie_word_embeddings=c.tie_embeddings,
    )
    return config, out


def llama_state(net: GPT) -> tuple[dict, dict]:
    """(LlamaConfig kwargs, LlamaForCausalLM state_dict): the fused qkv and gate/up matrices split by rows.

    Our rotary layout is Llama's ("rotate half"), so q and k need no permutation. With QK-norm the same
    names plus `self_attn.q_norm`/`k_norm` are Qwen3's (whose config has no `mlp_bias`).
    """
    c = net.cfg
    sd = sp_state_dict(net)  # muP's multipliers folded in: neither class has them
    H, KV, D = c.n_head * c.head_dim, c.n_kv_head * c.head_dim, c.hidden
    out = {"model.embed_tokens.weight": sd["wte.weight"]}
    for i in range(c.n_layer):
        p, h = f"blocks.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias") if c.bias else ("weight",):
            q, k, v = sd[p + f"attn.qkv.{kind}"].split([H, KV, KV])
            gate, up = sd[p + f"mlp.fc.{kind}"].split([D, D])
            out.update(
                {
                    h + f"self_attn.q_proj.{kind}": q,
                    h + f"self_attn.k_proj.{kind}": k,
                    h + f"self_attn.v_proj.{kind}": v,
                    h + f"self_attn.o_proj.{kind}": sd[p + f"attn.proj.{kind}"],
                    h + f"mlp.gate_proj.{kind}": gate,
                    h + f"mlp.up_proj.{kind}": up,
                    h + f"mlp.down_proj.{kind}": sd[p + f"mlp.proj.{kind}"],
                }
            )
        if c.qk_norm:
            out[h + "self_attn.q_norm.weight"] = sd[p + "attn.q_norm.weight"]
            out[h + "self_attn.k_norm.weight"] = sd[p + "attn.k_norm.weight"]
        out[h + "input_layernorm.weight"] = sd[p + "ln_1.weight"]
        out[h + "post_attention_layernorm.weight"] = sd[p + "ln_2.weight"]
    out["model.norm.weight"] = sd["ln_f.weight"]
    out["lm_head.weight"] = sd["lm_head.weight"]
    config = dict(
        vocab_size=c.vocab_size,
        hidden_size=c.d_model,
        intermediate_size=c.hidden,
        num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head,
        num_key_value_heads=c.n_kv_head,
        head_dim=c.head_dim,
        hidden_act="silu",
        max_position_embeddings=c.context_length,
        rms_norm_eps=c.norm_eps,
        rope_theta=float(c.rope_theta),
        tie_word_embeddings=c.tie_embeddings,
        attention_bias=c.bias,
        attention_dropout=c.dropout,
    )
    if c.qk_norm:
        config["use_sliding_window"] = False
    else:
        config["mlp_bias"] = c.bias
    return config, out


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
    kwargs, state = (gpt2_state if family == "gpt2" else llama_state)(net)
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
