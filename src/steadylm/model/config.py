"""`GPTConfig`: the transformer's shape and switches, checked at startup so a bad value stops the run with one
`ConfigError` naming the key. Free of torch: it builds no model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args, get_type_hints

from steadylm.errors import ConfigError, is_int, number


@dataclass
class GPTConfig:
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    context_length: int = 128
    vocab_size: int = 320
    dropout: float = 0.0
    bias: bool = True  # biases in every linear and LayerNorm (GPT-2); Llama has none
    qk_norm: bool = False  # normalise queries and keys per head: bounds attention logits at high LR
    init: Literal["gpt2", "xavier", "torch_default"] = "gpt2"
    pos: Literal["learned", "rope"] = "learned"
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama 3's: {rope_type: llama3, factor, low_freq_factor, high_freq_factor, ...}
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    norm_eps: float = 1e-5
    mlp: Literal["gelu", "gelu_tanh", "swiglu"] = "gelu"  # gelu_tanh: GPT-2's own tanh approximation (gelu_new)
    mlp_hidden: int | None = None  # null: 4·d_model (gelu), or Llama's 8/3·d_model (swiglu), rounded up
    mlp_multiple_of: int = 1  # the hidden size is rounded up to a multiple of this (256 in Llama)
    n_kv_head: int | None = None  # null: = n_head; fewer = grouped-query attention (must divide n_head)
    tie_embeddings: bool = True  # the output projection is the input embedding (one matrix)
    parametrization: Literal["sp", "mup"] = "sp"  # muP: the LR found at the base shape holds at any width (mup.py)
    mup_base_width: int | None = None  # mup: the d_model the LR was tuned at (null: this d_model)
    mup_base_head_dim: int | None = None  # mup: that model's head size (null: this head size)
    mup_output_mult: float = 1.0  # mup: muP's tunable alpha_output; the logits are scaled by it / width_mult
    logit_softcap: float | None = None  # c: logits = c·tanh(logits/c) (Gemma 2), so |logits| < c
    init_from: str | None = None  # a Hugging Face folder: its config.json is this shape, its weights the start (hf.py)
    # Recompute in backward instead of keeping: none | blocks (each block's activations, from its input) | selective
    # (a block's elementwise ops; its matmul outputs are kept). Gradients as none's.
    activation_checkpointing: Literal["none", "blocks", "selective"] = "none"

    def __post_init__(self) -> None:
        self.n_kv_head = self.n_head if self.n_kv_head is None else self.n_kv_head
        optional = ("mlp_hidden", "mup_base_width", "mup_base_head_dim")  # null: a default
        sizes = ("n_layer", "n_head", "d_model", "context_length", "vocab_size", "mlp_multiple_of", "n_kv_head")
        for key in (*sizes, *optional):
            if not (is_int(value := getattr(self, key)) and value > 0) and (value is not None or key in sizes):
                raise ConfigError(f"model.{key}={value!r} must be a whole number > 0")
        # The base shape muP measures width against (null: this model's own).
        self.mup_base_width = self.d_model if self.mup_base_width is None else self.mup_base_width
        self.mup_base_head_dim = self.head_dim if self.mup_base_head_dim is None else self.mup_base_head_dim
        for key in (
            "pos",
            "norm",
            "mlp",
            "init",
            "parametrization",
            "activation_checkpointing",
        ):  # the choices their annotations list
            if (value := getattr(self, key)) not in (allowed := get_args(get_type_hints(GPTConfig)[key])):
                raise ConfigError(f"model.{key}={value!r} is not allowed; use one of: {', '.join(allowed)}")
        if self.d_model % self.n_head:
            raise ConfigError(
                f"model.d_model={self.d_model} is not divisible by model.n_head={self.n_head}; "
                "each head gets d_model / n_head dimensions, so choose n_head dividing d_model"
            )
        if self.n_head % self.n_kv_head:
            raise ConfigError(
                f"model.n_kv_head={self.n_kv_head} does not divide model.n_head={self.n_head}; each key/value head "
                f"serves a whole group of query heads, so use a divisor of {self.n_head} (n_head itself = no grouping)"
            )
        if self.pos == "rope" and self.head_dim % 2:
            raise ConfigError(
                f"model.pos=rope needs an even head size, got d_model/n_head = {self.head_dim}; change model.n_head"
            )
        if self.pos == "rope" and not self.rope_theta > 0:
            raise ConfigError(
                f"model.rope_theta={self.rope_theta} must be > 0 (10000 in GPT-NeoX/Llama-2, 500000 in Llama-3)"
            )
        if self.rope_scaling is not None:  # Llama 3's (model/llama3_rope.py, loaded only then)
            from steadylm.model.llama3_rope import check_rope_scaling

            check_rope_scaling(self.rope_scaling, self.pos)
        for key in (k for k, t in get_type_hints(GPTConfig).items() if t is bool):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"model.{key}={getattr(self, key)!r} must be true or false")
        if not (self.logit_softcap is None or number(self.logit_softcap) > 0):
            raise ConfigError(f"model.logit_softcap={self.logit_softcap!r} must be a number > 0 (e.g. 15), or null")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"model.dropout={self.dropout} must be in [0, 1)")
        if not self.norm_eps > 0:
            raise ConfigError(f"model.norm_eps={self.norm_eps} must be > 0")
        if not (isinstance(self.mup_output_mult, (int, float)) and self.mup_output_mult > 0):
            raise ConfigError(
                f"model.mup_output_mult={self.mup_output_mult!r} must be a number > 0 (1: the logits / width_mult)"
            )
        mup = self.parametrization == "mup"
        if mup and self.init_from is not None:  # muP's multipliers would change what the published weights compute
            raise ConfigError(f"model.parametrization=mup cannot start from model.init_from={self.init_from}: use sp")
        if mup and self.init != "gpt2" and self.d_model != self.mup_base_width:
            raise ConfigError(
                f"model.parametrization=mup needs model.init=gpt2 off its base width, got {self.init!r} at d_model="
                f"{self.d_model}: muP's hidden init is gpt2's N(0, 0.02) shrunk by sqrt(width ratio), while xavier and "
                "torch_default pick their own width scaling; use model.init=gpt2 or model.parametrization=sp"
            )
        if mup and self.mup_base_width % self.mup_base_head_dim:
            raise ConfigError(
                f"model.mup_base_head_dim={self.mup_base_head_dim} does not divide model.mup_base_width="
                f"{self.mup_base_width}: the base model would have a fractional number of heads; give the base "
                "shape the LR was tuned at (tiny: 128 and 32)"
            )
        if mup and not 1 / 64 <= (ratio := self.d_model / self.mup_base_width) <= 1024:
            raise ConfigError(
                f"model.d_model={self.d_model} is {ratio:.3g}x model.mup_base_width={self.mup_base_width}: "
                "outside [1/64, 1024], which is a mistyped base width rather than a transfer; set "
                "model.mup_base_width to the d_model the LR was tuned at"
            )

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def hidden(self) -> int:
        """`mlp_hidden`, else 4·d (SwiGLU: 2/3 of it, a GELU MLP's parameter count), rounded up to `mlp_multiple_of`."""
        h = self.mlp_hidden or (int(2 * 4 * self.d_model / 3) if self.mlp == "swiglu" else 4 * self.d_model)
        return -(-h // self.mlp_multiple_of) * self.mlp_multiple_of
