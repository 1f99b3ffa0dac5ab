"""The coordinate check: is `model.parametrization` really width-independent, measured rather than assumed.

The same AdamW steps on the same tokens at three widths of the configured family (its pos, norm,
MLP, bias, QK-norm, tying and grouped-k/v switches; 2 layers, 4 heads, widths 64/128/256 with 64 as the
muP base), from two init seeds; after them, the RMS of every block's output, of its change since init (the
update's effect), and of the logits, each averaged over the seeds in log and fitted as width^slope. Under mup every slope must stay near 0: a coordinate
that grows with width means some multiplier is missing and the base LR will not transfer. Under sp the
block outputs grow about as width^2 with Adam, which is why sp's best LR shrinks as the model widens.
A proxy of the family, not the preset's own shape: it checks the multipliers, which depend on width
ratios only, in a few seconds on one CPU core. 32 steps and two seeds, not 8 and one: after 8 steps one
seed's slope scattered by 0.3-0.4 (sd over 5 seeds) in the Llama family, enough to cross the bar either way;
after 32 it scatters by 0.03-0.16 and a missing LR multiplier still shows as a slope above 1. It must never touch the run's model, data or files.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf

from steadylm.doctor.check import FAIL, OK, Check
from steadylm.model import GPT, GPTConfig
from steadylm.model.mup import param_groups

WIDTHS = (64, 128, 256)
HEADS, LAYERS, CONTEXT, BATCH = 4, 2, 32, 4
STEPS, LR = 32, 3e-3  # past the first steps' transient, where the slope is mostly seed noise (module docstring)
SEEDS = (0, 1)
FLAT = 0.5  # the largest |slope| a width-independent coordinate may show (x1.4 per doubling)
FAMILY_KEYS = ("pos", "rope_theta", "norm", "norm_eps", "mlp", "bias", "qk_norm", "tie_embeddings", "init")


@dataclass(frozen=True)
class CoordResult:
    parametrization: str
    widths: tuple[int, ...]
    values: dict[str, list[float]]  # metric -> one RMS per width
    slopes: dict[str, float]  # metric -> fitted exponent of width

    @property
    def worst(self) -> tuple[str, float]:
        return max(self.slopes.items(), key=lambda kv: abs(kv[1]))

    @property
    def flat(self) -> bool:
        return abs(self.worst[1]) <= FLAT


def proxy_config(model: dict, width: int, parametrization: str) -> GPTConfig:
    """The family of `model` at `width` (muP base: the narrowest width, 4 heads there)."""
    grouped = model.get("n_kv_head") not in (None, model["n_head"])
    return GPTConfig(
        **{k: model[k] for k in FAMILY_KEYS if k in model},
        n_layer=LAYERS,
        n_head=HEADS,
        n_kv_head=2 if grouped else HEADS,
        d_model=width,
        context_length=CONTEXT,
        vocab_size=min(int(model["vocab_size"]), 512),
        parametrization=parametrization,
        mup_base_width=WIDTHS[0],
        mup_base_head_dim=WIDTHS[0] // HEADS,
    )


def width_slope(widths: tuple[int, ...], values: list[float]) -> float:
    """Least-squares exponent a of value ~ width^a."""
    xs = [math.log(w) for w in widths]
    ys = [math.log(max(v, 1e-30)) for v in values]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _coordinates(net: GPT, x: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
    outs: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda m, i, o: outs.append(o.detach().float())) for b in net.blocks]
    try:
        with torch.no_grad():
            logits = net(x).float()
    finally:
        for h in hooks:
            h.remove()
    return outs, logits


def coord_check(
    model: dict,
    tokens: torch.Tensor,
    parametrization: str,
    betas: tuple[float, float] = (0.9, 0.95),
    groups: Callable[..., list[dict]] = param_groups,
    widths: tuple[int, ...] = WIDTHS,
    seeds: tuple[int, ...] = SEEDS,
) -> CoordResult:
    """Train each width STEPS steps on `tokens` (B, T+1) with `groups`' AdamW groups from each seed; fit each
    RMS (the geometric mean over seeds, so the slope is the seeds' mean slope) against width."""
    values: dict[str, list[float]] = {}
    for width in widths:
        rows = [_train_width(model, tokens, width, parametrization, betas, groups, seed) for seed in seeds]
        for key in rows[0]:
            values.setdefault(key, []).append(math.exp(statistics.fmean(math.log(max(r[key], 1e-30)) for r in rows)))
    slopes = {key: width_slope(widths, vs) for key, vs in values.items()}
    return CoordResult(parametrization, tuple(widths), values, slopes)


def _train_width(
    model: dict, tokens: torch.Tensor, width: int, parametrization: str, betas, groups, seed: int
) -> dict[str, float]:
    """One width, one seed: the RMS of each block's output, of its change over STEPS steps, and of the logits."""
    rms = lambda t: t.pow(2).mean().sqrt().item()  # noqa: E731
    cfg = proxy_config(model, width, parametrization)
    ids = tokens[:BATCH, : CONTEXT + 1] % cfg.vocab_size
    x, y = ids[:, :-1], ids[:, 1:]
    torch.manual_seed(seed)
    net = GPT(cfg)
    opt = torch.optim.AdamW(groups(net.named_parameters(), cfg, lr=LR, weight_decay=0.0), lr=LR, betas=betas)
    before, _ = _coordinates(net, x)
    for _ in range(STEPS):
        loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    after, logits = _coordinates(net, x)
    row = {f"blocks.{i}": rms(a) for i, a in enumerate(after)}
    row.update({f"Δblocks.{i}": rms(a - b) for i, (a, b) in enumerate(zip(after, before))})
    row["logits"] = rms(logits)
    return row


def check_coords(
    cfg: DictConfig, batch: tuple[torch.Tensor, torch.Tensor] | None, groups: Callable[..., list[dict]] = param_groups
) -> list[Check]:
    """The doctor row: mup must be flat in width; sp is shown growing (what makes its best LR move, and why
    `optim.lr_rule` moves the default LR with the width)."""
    name = "model: coordinate check"
    model = OmegaConf.to_container(cfg.model, resolve=True)
    if batch is None:  # the data rows failed already; a fixed random batch still exercises the multipliers
        tokens = torch.randint(
            0, int(model["vocab_size"]), (BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(0)
        )
    else:
        x, y = batch
        tokens = torch.cat([x, y[:, -1:]], dim=1)
    param = model.get("parametrization", "sp")
    result = coord_check(model, tokens, param, betas=tuple(cfg.optim.betas), groups=groups)
    key, worst = result.worst
    shown = ", ".join(f"{k} {s:+.2f}" for k, s in result.slopes.items())
    where = (
        f"widths {'/'.join(map(str, result.widths))}, {STEPS} AdamW steps at lr {LR:g}, {len(SEEDS)} seeds: "
        f"RMS ~ width^slope: {shown}"
    )
    if param != "mup":
        return [
            Check(
                name,
                OK,
                f"sp (grows with width, as expected: {key} {worst:+.2f}); {where}; "
                "optim.lr_rule lowers the LR with the width to match (docs/model.md)",
            )
        ]
    if not result.flat:
        return [
            Check(
                name,
                FAIL,
                f"mup is not width-independent: {key} grows as width^{worst:+.2f} (|slope| > {FLAT:g}); {where}",
                "a muP multiplier is missing or doubled: compare model/mup.py with docs/model.md's table",
            )
        ]
    return [Check(name, OK, f"mup flat in width (worst {key} {worst:+.2f}, |slope| <= {FLAT:g}); {where}")]
