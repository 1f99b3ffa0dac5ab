"""The default peak LR, `optim.lr`: a rule of the model's width and the tokens an optimizer step sees.

lr = `lr_rule.lr` · (d_model / `lr_rule.width`)^`width_exponent` · (tokens a step / `lr_rule.tokens`)^`tokens_exponent`,
fitted to the best LRs `benchmarks/mup_vs_sp.py --shapes` measured (docs/model.md). A wider model takes a lower LR
(sp's updates grow with width under Adam); a larger batch a higher one (its gradient is less noisy). The tokens a step
are `data.global_batch_tokens` where set, else batch × context × accumulation × devices (Lightning's own device
count, so `auto` on 8 GPUs is 8), which is why the rule is a resolver over the whole config: any of those overrides
moves the LR with it, and an explicit `optim.lr` replaces it. Under mup the width is the base's, where the LR is tuned.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from steadylm.devices import devices_of
from steadylm.errors import ConfigError, is_int


def _whole(value: Any) -> int | None:
    return int(value) if is_int(value) and value > 0 else None


def world_size(cfg: DictConfig) -> int:
    """The processes a step's batch is split over: Lightning's rules on this machine (`devices.py`); 1 for settings
    it refuses, which startup names in one line of its own."""
    try:
        return devices_of(cfg).world_size
    except ConfigError:
        return 1


def tokens_per_step(cfg: DictConfig) -> tuple[int | None, str]:
    """The tokens one optimizer step sees, and where the number came from (None: a value startup refuses)."""
    total = _whole(OmegaConf.select(cfg, "data.global_batch_tokens"))
    if total:
        return total, f"data.global_batch_tokens {total:,}"
    batch = _whole(OmegaConf.select(cfg, "data.batch_size"))
    context = _whole(OmegaConf.select(cfg, "model.context_length"))
    accumulate = _whole(OmegaConf.select(cfg, "trainer.accumulate_grad_batches", default=1)) or 1
    if not (batch and context):
        return None, "no tokens a step (data.batch_size or model.context_length is not a whole number > 0)"
    world = world_size(cfg) if OmegaConf.select(cfg, "trainer") is not None else 1
    tokens = batch * context * accumulate * world
    what = f"batch {batch} × context {context}"
    what += f" × accumulation {accumulate}" if accumulate != 1 else ""
    what += f" × {world} devices" if world != 1 else ""
    return tokens, f"{what} = {tokens:,} tokens a step"


def rule_lr(rule: Any, width: float, tokens: float | None) -> float:
    """The rule's LR at `width` and `tokens` a step (None: the rule's own tokens), to 3 significant digits."""
    lr = rule.lr * (width / rule.width) ** rule.width_exponent
    if tokens:
        lr *= (tokens / rule.tokens) ** rule.tokens_exponent
    return float(f"{lr:.3g}")


def rule_width(cfg: DictConfig) -> float | None:
    """The width the rule reads: the model's, or under mup its base's (None: a width the model refuses next)."""
    base = OmegaConf.select(cfg, "model.mup_base_width")
    mup = OmegaConf.select(cfg, "model.parametrization") == "mup"
    width = base if mup and base else OmegaConf.select(cfg, "model.d_model")
    return width if isinstance(width, (int, float)) and not isinstance(width, bool) and width > 0 else None


def lr_rule(rule: Any, *, _root_: DictConfig) -> float:
    """`${lr_rule:${optim.lr_rule}}`, optim.lr's default: the rule at this config's width and tokens a step."""
    width = rule_width(_root_)
    if width is None or not rule.width > 0:
        return float(rule.lr)  # a width the model's own check refuses next, in one line naming it
    return rule_lr(rule, width, tokens_per_step(_root_)[0])


def tokens_scale(cfg: DictConfig, tokens: int) -> tuple[float, str]:
    """The factor the rule's tokens term puts on an LR taken from this config's tokens a step to `tokens` (what a
    probe on a smaller batch must train at to stand for the run, as muP carries the LR to a narrower proxy), and a
    note saying so ("": no factor)."""
    rule, (run, _) = cfg.optim.get("lr_rule"), tokens_per_step(cfg)
    if rule is None or not run or not rule.get("tokens_exponent") or tokens == run:
        return 1.0, ""
    scale = (tokens / run) ** rule.tokens_exponent
    return scale, (
        f" (optim.lr x{scale:.3g}: the LR rule's tokens term from the run's {run:,} tokens a step to the probe's "
        f"{tokens:,})"
    )


def explain(cfg: DictConfig) -> str:
    """What `optim.lr` is and where it came from: the rule's terms, or an explicit value beside the rule's."""
    rule = cfg.optim.get("lr_rule")
    if rule is None:
        return f"optim.lr {cfg.optim.lr:.3g}"
    width, (tokens, how) = rule_width(cfg), tokens_per_step(cfg)
    if width is None:
        return f"optim.lr {cfg.optim.lr:.3g}"
    ruled = rule_lr(rule, width, tokens)
    mup = " (mup: its base width)" if OmegaConf.select(cfg, "model.parametrization") == "mup" else ""
    terms = (
        f"{rule.lr:g} × (width {width:g}{mup} / {rule.width:g})^{rule.width_exponent:g}"
        + (f" × ({tokens:,} / {rule.tokens:,} tokens)^{rule.tokens_exponent:g}" if tokens else "")
        + f" = {ruled:.3g}; {how}"
    )
    raw = OmegaConf.to_container(cfg.optim, resolve=False).get("lr")
    if isinstance(raw, str) and raw.startswith("${lr_rule:"):
        return f"optim.lr {cfg.optim.lr:.3g} from optim.lr_rule: {terms}"
    return f"optim.lr {cfg.optim.lr:.3g} set explicitly (optim.lr_rule would give {terms})"
