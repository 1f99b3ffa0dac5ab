"""Hugging Face's GPT-2 and Llama as names of our config fields and weights, written once and read both ways: export
writes a model under them (ours -> theirs), `model.init_from` reads a published one (theirs -> ours).

Free of `transformers`: `config.json` is JSON, the weights are safetensors files (sharded or not), so a training run
that starts from a published model loads this module and safetensors only. What `config.json` asks that our model
cannot compute (another activation, another rotary scaling, a per-layer pattern) is refused in one line naming the
field, never approximated; the test suite holds every field of transformers' own config classes to a rule here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from steadylm.errors import ConfigError, SteadyError

CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}

# Our GPTConfig field -> their config.json key, per family (qwen3 is written with llama's).
CONFIG_NAMES = {
    "gpt2": {
        "vocab_size": "vocab_size",
        "context_length": "n_positions",
        "d_model": "n_embd",
        "n_layer": "n_layer",
        "n_head": "n_head",
        "mlp_hidden": "n_inner",
        "norm_eps": "layer_norm_epsilon",
        "tie_embeddings": "tie_word_embeddings",
    },
    "llama": {
        "vocab_size": "vocab_size",
        "context_length": "max_position_embeddings",
        "d_model": "hidden_size",
        "n_layer": "num_hidden_layers",
        "n_head": "num_attention_heads",
        "n_kv_head": "num_key_value_heads",
        "mlp_hidden": "intermediate_size",
        "norm_eps": "rms_norm_eps",
        "rope_theta": "rope_theta",
        "tie_embeddings": "tie_word_embeddings",
        "bias": "attention_bias",
    },
}
# transformers' defaults for a key config.json leaves out (its config classes; a test holds them equal).
DEFAULTS = {
    "gpt2": {
        "vocab_size": 50257,
        "n_positions": 1024,
        "n_embd": 768,
        "n_layer": 12,
        "n_head": 12,
        "n_inner": None,
        "layer_norm_epsilon": 1e-5,
        "tie_word_embeddings": True,
        "activation_function": "gelu_new",
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "add_cross_attention": False,
    },
    "llama": {
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": None,
        "intermediate_size": 11008,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "head_dim": None,
    },
}
# The switches each family fixes, whatever config.json says.
FIXED = {
    "gpt2": {"pos": "learned", "norm": "layernorm", "bias": True, "n_kv_head": None, "rope_scaling": None},
    "llama": {"pos": "rope", "norm": "rmsnorm", "mlp": "swiglu"},
}
GELU = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}  # theirs -> our model.mlp
# Keys the model's function does not depend on: dropout (model.dropout is the run's), init, ids, runtime flags,
# GPT-2's unused summary head, a numerically equivalent attention upcast, Llama's sliced matmuls.
IGNORED = {
    "attn_pdrop", "embd_pdrop", "resid_pdrop", "attention_dropout", "initializer_range", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "summary_activation", "summary_first_dropout",
    "summary_proj_to_labels", "summary_type", "summary_use_proj", "reorder_and_upcast_attn", "pretraining_tp",
    "n_ctx", "task_specific_params",
}  # fmt: skip
# Keys other architectures carry, which a GPT-2 or Llama config must not ask for (transformers' GPT-2 and Llama
# would ignore them, computing something else than their authors trained).
UNREPRESENTED = (
    "layer_types",
    "sliding_window",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "rope_interleaved",
)


def _refuse(folder: Path, key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"model.init_from={folder}: config.json has {key}={json.dumps(value)}, {why}")


def read_config(folder: str | Path) -> dict:
    """`folder/config.json`, checked to be a local Hugging Face folder (a steadylm checkpoint is refused here)."""
    folder = Path(folder).expanduser()
    if folder.is_file():
        raise ConfigError(
            f"model.init_from={folder} is a file; it takes a Hugging Face folder (config.json + *.safetensors); "
            "a steadylm checkpoint's weights are loaded by init_from=<file.ckpt>"
        )
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"model.init_from={folder}: no config.json there; give a local Hugging Face model folder "
            "(e.g. one saved by save_pretrained, or downloaded with `hf download NAME --local-dir DIR`)"
        )
    try:
        return json.loads((folder / "config.json").read_text())
    except ValueError as e:
        raise ConfigError(f"model.init_from={folder}: config.json is not JSON ({e})") from None


def _rope(folder: Path, raw: dict) -> tuple[float, dict | None]:
    """(rope_theta, our rope_scaling) from transformers 5's `rope_parameters` or 4's `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters")
    key = "rope_parameters" if params is not None else "rope_scaling"
    scaling = dict(params if params is not None else raw.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", raw.get("rope_theta", DEFAULTS["llama"]["rope_theta"]))
    kind = scaling.pop("rope_type", scaling.pop("type", "default"))
    if kind == "default" and not scaling:
        return float(theta), None
    if kind != "llama3":
        raise _refuse(folder, f"{key}.rope_type", kind, "which steadylm cannot represent (it has default and llama3)")
    from steadylm.model.llama3_rope import LLAMA3_ROPE

    if unknown := sorted(set(scaling) - set(LLAMA3_ROPE)):
        raise _refuse(folder, f"{key}.{unknown[0]}", scaling[unknown[0]], "which llama3 rotary scaling does not have")
    return float(theta), {"rope_type": "llama3", **scaling}


def model_values(folder: str | Path) -> dict[str, Any]:
    """The GPTConfig fields `folder`'s config.json describes (its family's fixed switches included)."""
    folder = Path(folder).expanduser()
    raw = read_config(folder)
    family = raw.get("model_type")
    if family not in ("gpt2", "llama"):
        raise _refuse(folder, "model_type", family, "not gpt2 or llama, the families steadylm imports (docs/model.md)")
    get = lambda key: raw.get(key, DEFAULTS[family][key])  # noqa: E731
    for key in UNREPRESENTED:
        if raw.get(key) not in (None, False):
            raise _refuse(folder, key, raw[key], f"which steadylm's {family} cannot represent")
    values = {ours: get(theirs) for ours, theirs in CONFIG_NAMES[family].items() if theirs != "rope_theta"}
    values |= {**FIXED[family], "qk_norm": False, "mlp_multiple_of": 1, "logit_softcap": None}
    if family == "gpt2":
        act = get("activation_function")
        if act not in GELU:
            raise _refuse(
                folder, "activation_function", act, f"which steadylm cannot represent (it has {', '.join(GELU)})"
            )
        values["mlp"] = GELU[act]
        for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
            if get(key) != want:
                raise _refuse(folder, key, get(key), f"which steadylm cannot represent (it has {json.dumps(want)})")
        if get("add_cross_attention"):
            raise _refuse(folder, "add_cross_attention", True, "a decoder of another model; steadylm's has none")
        return values
    if get("hidden_act") != "silu":
        raise _refuse(folder, "hidden_act", get("hidden_act"), "which steadylm cannot represent (it has silu)")
    if get("mlp_bias") != get("attention_bias"):
        raise _refuse(
            folder, "mlp_bias", get("mlp_bias"), f"unlike attention_bias={json.dumps(get('attention_bias'))}: "
            "steadylm's model.bias sets both"
        )  # fmt: skip
    head_dim = get("head_dim")
    if head_dim is not None and head_dim * values["n_head"] != values["d_model"]:
        raise _refuse(folder, "head_dim", head_dim, "not hidden_size / num_attention_heads, which steadylm assumes")
    values["rope_theta"], values["rope_scaling"] = _rope(folder, raw)
    return values


def pretrained_shape(cfg) -> dict[str, Any]:
    """`model.init_from`'s config.json as dotted `model.*` values for `resolve.fill`: a `model.*` key the user set
    against it is refused (context_length may be lowered: positions beyond it are not used)."""
    from hydra.core.hydra_config import HydraConfig

    folder = cfg.model.init_from
    if cfg.get("init_from") is not None:
        raise ConfigError(
            f"both init_from={cfg.init_from} and model.init_from={folder} are set; init_from loads a steadylm "
            "checkpoint's weights into the configured model, model.init_from a Hugging Face model: pass one"
        )
    values = model_values(folder)
    overrides = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    user = {
        o.lstrip("+~").split("=", 1)[0].removeprefix("model.") for o in overrides if o.startswith(("model.", "+model."))
    }
    for key in sorted(user & set(values)):
        mine = cfg.model[key]
        if key == "context_length" and isinstance(mine, int) and 0 < mine <= values[key]:
            values[key] = mine
        elif mine != values[key]:
            raise ConfigError(
                f"model.{key}={json.dumps(mine) if isinstance(mine, bool) else mine} contradicts model.init_from="
                f"{folder}, whose config.json gives "
                f"{json.dumps(values[key])}; drop model.{key} (the checkpoint sets the model's shape"
                + (", and a context_length may only be lowered)" if key == "context_length" else ")")
            )
    return {f"model.{k}": v for k, v in values.items()}


def tokenizer_file(folder: str | Path) -> Path | None:
    """The folder's `tokenizer.json`, or None."""
    path = Path(folder).expanduser() / "tokenizer.json"
    return path if path.is_file() else None


# --- the weights -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Name:
    """One of our tensors as theirs: one name, or several rows of ours (`split`), transposed (GPT-2's `Conv1D`)."""

    ours: str
    theirs: tuple[str, ...]
    split: tuple[int, ...] | None = None
    transpose: bool = False


def family_of(cfg) -> str:
    """The family a GPTConfig's switches are written as (export refuses what none of them expresses first)."""
    return "gpt2" if cfg.pos == "learned" else "qwen3" if cfg.qk_norm else "llama"


def weight_names(cfg, family: str) -> list[Name]:
    """Every tensor of a GPT `cfg` and its name(s) in `family`'s state_dict; biases as `cfg.bias` (GPT-2: always)."""
    if family == "gpt2":
        names = [Name("wte.weight", ("transformer.wte.weight",)), Name("wpe.weight", ("transformer.wpe.weight",))]
        for i in range(cfg.n_layer):
            p, h = f"blocks.{i}.", f"transformer.h.{i}."
            for ours, theirs, linear in (
                ("ln_1", "ln_1", False), ("attn.qkv", "attn.c_attn", True), ("attn.proj", "attn.c_proj", True),
                ("ln_2", "ln_2", False), ("mlp.fc", "mlp.c_fc", True), ("mlp.proj", "mlp.c_proj", True),
            ):  # fmt: skip
                names.append(Name(p + ours + ".weight", (h + theirs + ".weight",), transpose=linear))
                names.append(Name(p + ours + ".bias", (h + theirs + ".bias",)))
        names += [Name("ln_f.weight", ("transformer.ln_f.weight",)), Name("ln_f.bias", ("transformer.ln_f.bias",))]
        return names + [Name("lm_head.weight", ("lm_head.weight",))]
    H, KV, D = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim, cfg.hidden
    names = [Name("wte.weight", ("model.embed_tokens.weight",))]
    for i in range(cfg.n_layer):
        p, h = f"blocks.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias") if cfg.bias else ("weight",):
            qkv = tuple(f"{h}self_attn.{x}_proj.{kind}" for x in "qkv")
            names += [
                Name(f"{p}attn.qkv.{kind}", qkv, split=(H, KV, KV)),
                Name(f"{p}attn.proj.{kind}", (f"{h}self_attn.o_proj.{kind}",)),
                Name(f"{p}mlp.fc.{kind}", (f"{h}mlp.gate_proj.{kind}", f"{h}mlp.up_proj.{kind}"), split=(D, D)),
                Name(f"{p}mlp.proj.{kind}", (f"{h}mlp.down_proj.{kind}",)),
            ]
        if cfg.qk_norm:
            names += [Name(f"{p}attn.{x}_norm.weight", (f"{h}self_attn.{x}_norm.weight",)) for x in "qk"]
        names += [
            Name(p + "ln_1.weight", (h + "input_layernorm.weight",)),
            Name(p + "ln_2.weight", (h + "post_attention_layernorm.weight",)),
        ]
    return names + [Name("ln_f.weight", ("model.norm.weight",)), Name("lm_head.weight", ("lm_head.weight",))]


def to_hf(sd: dict[str, torch.Tensor], cfg, family: str) -> dict[str, torch.Tensor]:
    """Our state_dict `sd` under `family`'s names; a bias GPT-2 has and `cfg.bias=false` lacks is zeros."""
    out = {}
    for n in weight_names(cfg, family):
        t = sd.get(n.ours)
        if t is None:  # GPT-2's bias of a model without biases: zeros as long as its weight's rows
            t = torch.zeros(sd[n.ours.removesuffix(".bias") + ".weight"].shape[0], dtype=sd["wte.weight"].dtype)
        t = t.t().contiguous() if n.transpose else t
        out.update(zip(n.theirs, t.split(list(n.split)) if n.split else (t,)))
    return out


def from_hf(theirs: dict[str, torch.Tensor], cfg, family: str, where: str) -> dict[str, torch.Tensor]:
    """`family`'s state_dict as ours for `cfg`: GPT-2's older unprefixed names and attention-mask buffers accepted,
    a tied head taken from the embedding, the position table cut to `cfg.context_length`; a missing or unused
    tensor, or a wrong shape, refused in one line."""
    if family == "gpt2" and "transformer.wte.weight" not in theirs:  # the original checkpoints: no prefix
        theirs = {k if k.startswith("lm_head.") else "transformer." + k: v for k, v in theirs.items()}
    buffers = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")  # masks and tables, not weights
    left = {k for k in theirs if not k.endswith(buffers)}
    sd = {}
    for n in weight_names(cfg, family):
        if n.ours == "lm_head.weight" and cfg.tie_embeddings:
            left.discard("lm_head.weight")
            sd[n.ours] = sd["wte.weight"]
            continue
        if missing := [k for k in n.theirs if k not in theirs]:
            raise SteadyError(f"{where}: the weights lack {missing[0]}, which config.json's {family} model needs")
        t = torch.cat([theirs[k] for k in n.theirs]) if n.split else theirs[n.theirs[0]]
        left -= set(n.theirs)
        sd[n.ours] = t.t() if n.transpose else t[: cfg.context_length] if n.ours == "wpe.weight" else t
    if left:
        raise SteadyError(
            f"{where}: the weights hold {sorted(left)[0]}, which config.json's {family} model has no use for"
        )
    return sd


def read_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's `model.safetensors`, or of the shards its `model.safetensors.index.json` lists."""
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise SteadyError("model.init_from needs the safetensors package: pip install safetensors") from None
    folder = Path(folder).expanduser()
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise SteadyError(
            f"model.init_from={folder}: no model.safetensors or model.safetensors.index.json there (a pickled "
            "pytorch_model.bin is not read: loading it can run code); save the model with safetensors"
        )
    out = {}
    for name in files:
        out |= load_file(str(folder / name))
    return out


def load_pretrained(net: torch.nn.Module, folder: str | Path) -> str:
    """Copy `folder`'s weights into `net`, a GPT built from `model_values(folder)` (checked to fit exactly); the
    folder, as `LMModule.weights_from` records it."""
    family = "gpt2" if net.cfg.pos == "learned" else "llama"
    sd = from_hf(read_weights(folder), net.cfg, family, f"model.init_from={folder}")
    ours = net.state_dict()
    if wrong := [k for k in ours if k in sd and sd[k].shape != ours[k].shape]:
        raise SteadyError(
            f"model.init_from={folder}: {wrong[0]} is {tuple(sd[wrong[0]].shape)} in the weights but config.json "
            f"makes it {tuple(ours[wrong[0]].shape)}; the folder's config.json and weights disagree"
        )
    net.load_state_dict(sd)
    return str(folder)
