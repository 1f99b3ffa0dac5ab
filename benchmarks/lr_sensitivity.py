"""LR sensitivity per stabiliser (Wortsman et al. 2023, "Small-scale proxies for large-scale Transformer
training instabilities"): final val loss over an LR sweep, and one number per curve.

For each variant {baseline (no QK-norm), QK-norm, z-loss 1e-4, QK-norm + z-loss, the default QK-clip policy
on the baseline} and each LR of a log grid from 3e-4 to 3e-1, a small GPT trains for `--steps` steps on the
embedded corpus (the real `LMModule` loss and AdamW groups, warmup then cosine, clipping 1.0); its final val
loss is the mean over fixed val batches. LR sensitivity = mean over LRs of min(loss(lr), loss at init) minus
the best loss of the curve: 0 for a curve that is flat at its best, up to (init - best) for one that
diverges everywhere else. The default policy runs `QKClip.step` after each update with the settings of
conf/callbacks/default.yaml, as `callbacks.stability.qk_clip` does, applies its LR backoff to every group and
rewinds to an in-memory snapshot (every `recovery.every_n_steps`, `keep` of them) as `Recovery.rewind` does,
then warms the LR up again over `rewarm_steps` as `Schedule.lr_of` does.

Prints each curve and the sensitivity; `--png` saves the plot (docs/lr_sensitivity.png).
Usage: python benchmarks/lr_sensitivity.py [--steps N (150)] [--png FILE] [--quick] [--only VARIANT ...]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from steadylm.data.datamodule import ShardDataModule  # noqa: E402
from steadylm.data.prepare import prepare  # noqa: E402
from steadylm.module import LMModule  # noqa: E402
from steadylm.stability.qk_clip import QKClip  # noqa: E402

MODEL = dict(n_layer=2, n_head=4, d_model=128, context_length=64, vocab_size=320, qk_norm=False)
OPTIM = dict(
    lr=1e-3, min_lr=0.0, weight_decay=0.1, betas=[0.9, 0.95], eps=1e-8, warmup_steps=0, total_steps=1, fused=False
)
# The default policy of conf/callbacks/default.yaml (callbacks.stability.qk_clip and recovery's snapshots).
DEFAULTS = OmegaConf.load(ROOT / "conf" / "callbacks" / "default.yaml").stability
QK_CLIP = {k: v for k, v in OmegaConf.to_container(DEFAULTS.qk_clip).items() if k != "every_n_steps"}
SNAPSHOT_EVERY, SNAPSHOT_KEEP = DEFAULTS.recovery.every_n_steps, DEFAULTS.recovery.keep
VARIANTS = {
    "baseline": ({}, {}, False),
    "qk_norm": ({"qk_norm": True}, {}, False),
    "z_loss": ({}, {"z_loss": 1e-4}, False),
    "qk_norm+z_loss": ({"qk_norm": True}, {"z_loss": 1e-4}, False),
    "default (qk_clip)": ({}, {}, True),
}


def batches(dm, split: str, n: int, batch: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = dm.train_set if split == "train" else dm.val_set
    g = torch.Generator().manual_seed(seed)
    out = []
    for row in torch.randint(0, len(data), (n, batch), generator=g):
        x, y = zip(*(data[int(i)] for i in row))
        out.append((torch.stack(x), torch.stack(y)))
    return out


@torch.no_grad()
def val_loss(module: LMModule, val) -> float:
    module.eval()
    total = sum(module.loss(module(x), y)[0].item() for x, y in val) / len(val)
    module.train()
    return total if math.isfinite(total) else float("inf")


def train(model: dict, optim: dict, clip: bool, lr: float, steps: int, train_b, val) -> float:
    torch.manual_seed(0)
    warmup = steps // 10
    schedule_keys = {"lr": lr, "min_lr": lr / 10, "warmup_steps": warmup, "total_steps": steps}
    module = LMModule(model=model, optim={**optim, **schedule_keys})
    schedule = module.schedule
    opt = module.configure_optimizers()
    params = [p for p in module.parameters() if p.requires_grad]
    attns = [b.attn for b in module.net.blocks]
    policy = QKClip(**QK_CLIP) if clip else None
    snapshots: list[tuple[int, int, dict, dict]] = []  # (step, applied, weights, optimizer): Recovery's, in memory
    skipped, rewarm = 0, (0, 0)  # the module's `rewarm`: (applied step it began, its length)
    first = None  # Recovery's first snapshot, held through the warmup (Stability._hold_first_through_warmup)
    for step in range(steps):
        x, y = train_b[step % len(train_b)]
        hold = policy and step - skipped <= warmup + policy.backoff_after
        first = first if hold else None
        if policy and step % SNAPSHOT_EVERY == 0:
            copy = copy_state(module.state_dict()), copy_state(opt.state_dict())
            snapshots = [*snapshots, (step, step - skipped, *copy)][-SNAPSHOT_KEEP:]
            first = first or (snapshots[-1] if hold else None)
        scale = policy.lr_scale if policy else 1.0
        at = step - skipped
        for group in opt.param_groups:
            group["lr"] = schedule.lr_of(at, scale, rewarm)
        for a in attns:
            a.track_max_logit = clip
        loss, _ = module.loss(module(x), y)
        if not math.isfinite(loss.item()):
            return float("inf")
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if policy:
            evidence = policy.step(step, [a.head_max_logit for a in attns], attns)
            before = (evidence or {}).get("rewind_before")
            good = [s for s in snapshots if before is not None and s[0] <= before]
            if good or (first and before is not None):  # Recovery.rewind: the held first snapshot, else one
                to, applied, weights, optim = first or (good[-2] if len(good) > 1 else good[-1])  # before the newest
                module.load_state_dict(weights)
                opt.load_state_dict(copy_state(optim))
                snapshots = [s for s in snapshots if s[0] <= to] or [first]
                skipped = step + 1 - applied
                rewarm = (applied, policy.rewarm_steps)
    return val_loss(module, val)


def copy_state(state):
    return {
        k: copy_state(v) if isinstance(v, dict) else v.clone() if torch.is_tensor(v) else v for k, v in state.items()
    }


def sensitivity(losses: list[float], init: float) -> float:
    return sum(min(v, init) for v in losses) / len(losses) - min(losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--quick", action="store_true", help="3 LRs, 60 steps: a smoke run")
    parser.add_argument("--png", type=Path, default=None)
    parser.add_argument("--only", choices=list(VARIANTS), action="append", help="these variants only (repeatable)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lrs = [3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1]
    steps = args.steps
    if args.quick:
        lrs, steps = [1e-3, 3e-2, 3e-1], 60
    with tempfile.TemporaryDirectory() as tmp:
        prepare(input=None, out_dir=tmp, max_bytes=2_000_000, val_fraction=0.05, progress=False)
        dm = ShardDataModule(dir=tmp, batch_size=16, context_length=MODEL["context_length"], num_workers=0)
        dm.setup("fit")
        train_b, val = batches(dm, "train", 64, 16, 0), batches(dm, "val", 8, 16, 1)
    init = val_loss(LMModule(model=MODEL, optim=OPTIM), val)
    print(f"LR sensitivity, {steps} steps, L{MODEL['n_layer']} d{MODEL['d_model']}; loss at init {init:.3f}")
    print(f"{'variant':18} " + " ".join(f"{lr:>7.0e}" for lr in lrs) + "  sensitivity")
    curves = {}
    started = time.perf_counter()
    for name, (m, o, clip) in VARIANTS.items():
        if args.only and name not in args.only:
            continue
        losses = [train({**MODEL, **m}, {**OPTIM, **o}, clip, lr, steps, train_b, val) for lr in lrs]
        curves[name] = losses
        print(f"{name:18} " + " ".join(f"{v:7.3f}" for v in losses) + f"  {sensitivity(losses, init):.3f}")
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.png:
        plot(curves, lrs, init, steps, args.png)


def plot(curves: dict[str, list[float]], lrs: list[float], init: float, steps: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, losses in curves.items():
        ax.plot(lrs, [min(v, init) for v in losses], "o-", label=f"{name} ({sensitivity(losses, init):.3f})")
    ax.set_xscale("log")
    ax.set_xlabel("peak LR")
    ax.set_ylabel(f"final val loss ({steps} steps, capped at init)")
    ax.set_title("LR sensitivity (Wortsman et al. 2023)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
