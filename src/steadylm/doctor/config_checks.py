"""Config rows: the startup refusals, clipping, precision for the hardware, the LR schedule."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from steadylm.config import context_length_copies, validate_config
from steadylm.derived import padded_vocab
from steadylm.devices import devices_of, resolve_precision
from steadylm.doctor.check import FAIL, OK, WARN, Check, guarded
from steadylm.lr_rule import explain
from steadylm.schedule import Schedule


def check_startup(cfg: DictConfig) -> list[Check]:
    """The refusals `train.py` makes at startup (one context length, min_lr <= lr, warmup < total)."""
    name = "config: context length, LR range, warmup"
    validate_config(cfg)
    copies = ", ".join(f"{k}={v}" for k, v in context_length_copies(cfg)) or "no copies"
    o = cfg.optim
    return [
        Check(
            name,
            OK,
            f"model.context_length={cfg.model.context_length} ({copies}); lr {o.lr:g} >= min_lr "
            f"{o.min_lr:g}; warmup {o.warmup_steps} < {o.total_steps} total steps",
        )
    ]


def check_clipping(cfg: DictConfig) -> list[Check]:
    name = "config: gradient clipping"
    t = cfg.trainer
    clip = t.get("gradient_clip_val")
    if not clip or float(clip) <= 0:
        return [
            Check(
                name,
                FAIL,
                f"trainer.gradient_clip_val={clip}: one bad batch can take an unbounded step",
                "set trainer.gradient_clip_val=1.0",
            )
        ]
    if t.get("gradient_clip_algorithm", "norm") != "norm":
        return [
            Check(
                name,
                WARN,
                f"trainer.gradient_clip_algorithm={t.gradient_clip_algorithm} clips each entry, "
                "which changes the update direction",
                "set trainer.gradient_clip_algorithm=norm",
            )
        ]
    return [Check(name, OK, f"global-norm clipping at {float(clip):g}")]


def precision_of(cfg: DictConfig) -> str:
    """The precision the Trainer will run, in Lightning's "<dtype>-<mode>" spelling."""
    return resolve_precision(cfg.trainer.precision, devices_of(cfg).accelerator)


def check_precision(cfg: DictConfig) -> list[Check]:
    name = "config: precision"
    raw, p, gpu = str(cfg.trainer.precision), precision_of(cfg), devices_of(cfg).on_cuda
    where = torch.cuda.get_device_name(0) if gpu else "CPU"
    key = f"trainer.precision={raw}" + (f" (-> {p})" if p != raw else "")
    if p == "16-true":
        return [
            Check(
                name,
                FAIL,
                f"{key}: fp16 weights with no loss scaler; small gradients underflow to 0 and large ones overflow",
                "use trainer.precision=bf16-mixed (or 16-mixed, which scales the loss)",
            )
        ]
    if p == "16-mixed" and not gpu:
        return [
            Check(
                name,
                FAIL,
                f"{key} on {where}: fp16 loss scaling needs a CUDA GPU",
                "use trainer.precision=32-true (or bf16-mixed) on CPU",
            )
        ]
    if p.startswith("bf16") and gpu and not torch.cuda.is_bf16_supported():
        return [Check(name, FAIL, f"{key}: {where} has no bf16 support", "use trainer.precision=16-mixed on this GPU")]
    if p == "bf16-true":
        return [
            Check(
                name,
                WARN,
                f"{key}: bf16 weights with no fp32 master copy drop updates smaller than ~1/256 of a weight",
                "use trainer.precision=bf16-mixed",
            )
        ]
    if p == "16-mixed":
        return [Check(name, OK, f"{key} on {where}: loss scaler on; watch optim/loss_scale and optim/skipped_steps")]
    if p not in ("bf16-mixed", "32-true", "64-true"):
        return [
            Check(name, FAIL, f"{key} is not a precision Lightning knows", "use auto, bf16-mixed, 16-mixed or 32-true")
        ]
    return [Check(name, OK, f"{key} on {where}")]


def check_schedule(cfg: DictConfig, png: Path) -> list[Check]:
    """The LR over the whole run, from the same `Schedule` the module steps, and where its peak came from (the LR
    rule's terms, or an explicit optim.lr beside the rule's); the curve goes to a PNG."""
    from steadylm.plots import plot_lr_schedule

    name = "schedule: LR curve"
    o, max_steps = cfg.optim, int(cfg.trainer.max_steps)
    if max_steps <= 0:
        return [
            Check(
                name,
                FAIL,
                f"trainer.max_steps={max_steps}: the run has no length, so the schedule has no end",
                "set trainer.max_steps to the number of optimizer steps",
            )
        ]
    schedule = Schedule.from_optim(o)
    lrs = [schedule(s) for s in range(max_steps)]
    plot_lr_schedule(lrs, schedule, png)
    peak = max(range(max_steps), key=lrs.__getitem__)
    evidence = (
        f"{schedule.describe()}; peak {lrs[peak]:.3g} at step {peak}, {lrs[-1]:.3g} at step {max_steps - 1}; "
        f"{explain(cfg)}; plot {png}"
    )
    if int(o.total_steps) != max_steps:
        return [
            Check(
                name,
                WARN,
                f"optim.total_steps={o.total_steps} but trainer.max_steps={max_steps}: the schedule "
                f"ends at the wrong step; {evidence}",
                "leave optim.total_steps=${trainer.max_steps}",
            )
        ]
    if int(o.warmup_steps) == 0:
        return [
            Check(
                name,
                WARN,
                f"optim.warmup_steps=0: full LR before Adam's second moment settles; {evidence}",
                "set optim.warmup_steps to ~1-5% of trainer.max_steps",
            )
        ]
    return [Check(name, OK, evidence)]


def check_vocab_padding(cfg: DictConfig) -> list[Check]:
    """A vocab that is a multiple of 64 keeps the embedding/LM-head matmuls on fast tensor-core tiles."""
    name = "config: vocab padding"
    v = int(cfg.model.vocab_size)
    if v % 64:
        padded = padded_vocab(v)
        return [
            Check(
                name,
                WARN,
                f"model.vocab_size={v} is not a multiple of 64 (slower LM head on GPUs)",
                f"set model.vocab_size={padded}",
            )
        ]
    return [Check(name, OK, f"model.vocab_size={v} = 64 x {v // 64}")]


def config_checks(cfg: DictConfig) -> list[Check]:
    rows: list[Check] = []
    for name, fn in (
        ("config: context length, LR range, warmup", check_startup),
        ("config: gradient clipping", check_clipping),
        ("config: precision", check_precision),
        ("config: vocab padding", check_vocab_padding),
    ):
        rows += guarded(name, lambda fn=fn: fn(cfg))
    return rows
