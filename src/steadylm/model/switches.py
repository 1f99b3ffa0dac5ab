"""What each `GPTConfig` field means to the export, the FLOP count and the memory estimate, which read the config.
`None`: that reader refuses any value but `neutral` (the model as if the field did not exist); an undeclared
field is refused by every reader, never silently mis-counted or mis-exported. Free of torch."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from steadylm.errors import ConfigError

READERS = {
    "export": "the Hugging Face export (export.py)",
    "flops": "the FLOP count (GPT.flops_per_token, behind perf/mfu)",
    "memory": "the memory estimate (memory.py)",
}
_show = lambda value: "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


@dataclass(frozen=True)
class Switch:
    export: str | None  # how export maps it (None: it cannot)
    flops: str | None  # how flops_per_token counts it (None: it cannot)
    memory: str | None  # how the memory estimate counts it (None: it cannot)
    neutral: Any = None  # the value a reader that cannot handle the field accepts


N = "6N (through the parameter count)"
PARAMS = "the parameter count"
NONE = "no cost: elementwise"
MUP = Switch("folded into the weights (export.sp_state_dict)", NONE, "nothing: multipliers only")

SWITCHES: dict[str, Switch] = {
    "n_layer": Switch("n_layer / num_hidden_layers", "6N + 12·L·d·T", "parameters; activations per layer"),
    "n_head": Switch("n_head / num_attention_heads", "scores count d_model, not heads", "no T×T scores (fused)"),
    "d_model": Switch("n_embd / hidden_size", "6N + 12·L·d·T", "parameters; 34·d activations per token"),
    "context_length": Switch("n_positions / max_position_embeddings", "12·L·d·T", "tokens per batch"),
    "vocab_size": Switch("vocab_size", N, "parameters; the fp32 logits"),
    "dropout": Switch("resid/embd/attn_pdrop; attention_dropout", NONE, "masks, within 34·d"),
    "bias": Switch("zero biases (GPT-2); attention_bias, mlp_bias (Llama)", N, PARAMS),
    "qk_norm": Switch("Qwen3ForCausalLM with rope; refused with learned positions", N, PARAMS),
    "init": Switch("nothing: the weights carry it", "nothing", "nothing"),
    "pos": Switch("learned: GPT-2; rope: Llama or Qwen3", N + "; the position table is not multiplied", PARAMS),
    "rope_theta": Switch("rope_theta", NONE, "nothing"),
    "rope_scaling": Switch("rope_scaling (Llama 3's)", NONE, "nothing"),
    "norm": Switch("must be the family's (refused otherwise)", NONE, PARAMS),
    "norm_eps": Switch("layer_norm_epsilon / rms_norm_eps", "nothing", "nothing"),
    "mlp": Switch("must be the family's (refused otherwise); gelu_tanh: GPT-2's gelu_new", N, PARAMS),
    "mlp_hidden": Switch("n_inner / intermediate_size", N, PARAMS),
    "mlp_multiple_of": Switch("n_inner / intermediate_size", N, PARAMS),
    "n_kv_head": Switch("num_key_value_heads (Llama); refused for GPT-2", N + "; scores count query heads", PARAMS),
    "tie_embeddings": Switch("tie_word_embeddings", "6N counts the tied matrix once", PARAMS),
    "parametrization": MUP,
    "mup_base_width": MUP,
    "mup_base_head_dim": MUP,
    "mup_output_mult": MUP,
    "logit_softcap": Switch(None, NONE, "8 more bytes a logit (its fp32 tanh)"),
    "init_from": Switch("nothing: the weights carry it", "nothing", "nothing"),
    "activation_checkpointing": Switch(
        "nothing: training only", "nothing: model FLOPs leave the recompute out", "activations kept per layer"
    ),
}


def require_understood(cfg: Any, reader: str) -> None:
    """Raise ConfigError naming the first field of `cfg` (a GPTConfig) that `reader` cannot handle at its value."""
    for f in fields(cfg):
        switch, value = SWITCHES.get(f.name), getattr(cfg, f.name)
        if switch is None:
            raise ConfigError(
                f"model.{f.name} is not declared in steadylm/model/switches.py, so {READERS[reader]} cannot know "
                f"what it means; add it to SWITCHES with what export, the FLOP count and the memory estimate do with it"
            )
        if getattr(switch, reader) is None and value != switch.neutral:
            raise ConfigError(
                f"model.{f.name}={_show(value)} is not understood by {READERS[reader]}; use model.{f.name}="
                f"{_show(switch.neutral)}, or teach it and say how in SWITCHES (steadylm/model/switches.py)"
            )
