"""`optim=muon`: Muon on the hidden matrices, AdamW on the rest, in one optimizer that can skip a step on the device.

Muon (Jordan et al. 2024; Moonlight, Liu et al. 2025) is SGD momentum whose update for each weight matrix is
replaced by the nearest semi-orthogonal matrix (a Newton–Schulz iteration), so every direction of the matrix
moves by the same amount and a few dominant directions cannot take the whole step. It suits the hidden
matrices of the blocks (attention, MLP); embeddings, the output head, norms and biases keep AdamW.

Owned rather than `torch.optim.Muon` because the stability suite needs three things torch's lacks: both kinds
of groups in one optimizer (one state_dict for snapshots, rollback and resume), fused projections
orthogonalised per part (q, k, v; gate, up), and the device-side skip: when the suite sets `opt.found_inf`
(a 0-dim float tensor, 1.0 = this step is non-finite) the AdamW groups go through fused AdamW's own
`found_inf`, and the Muon groups keep momentum and weights by `torch.where` (never a multiply: 0 · NaN is NaN).
`step()` must never read a device value on the host: that is the sync the deferred suite exists to avoid.
torch 2.13's also iterates in bf16 with one (a, b, c) for every step (no `ns_dtype`, no `polar_express`), one
matrix at a time, updating in place (docs/decisions.md). Only `optim=muon` imports this module.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim.adamw import adamw

from steadylm import compat
from steadylm.errors import is_int, number

# Each Newton-Schulz iteration applies p(X) = a·X + b·(XXᵀ)X + c·(XXᵀ)²X; a schedule lists (a, b, c) per iteration
# (its last entry repeats past its end) and the safety factor the input norm is divided by.
NS_SCHEDULES = {
    # Keller Jordan's quintic: steepest slope at 0, so 5 steps bring every singular value into ~[0.7, 1.2].
    "quintic": (((3.4445, -4.7750, 2.0315),), 1.0),
    # Polar Express (Amsel et al. 2025, arXiv 2505.16932): the minimax-optimal quintic for each iteration in turn,
    # with its 2 % safety factor: at the same cost, 5 steps leave ~[0.86, 1.14] (docs/performance.md).
    "polar_express": (
        (
            (8.156554524902461, -22.48329292557795, 15.878769915207462),
            (4.042929935166739, -2.808917465908714, 0.5000178451051316),
            (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
            (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
            (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
        ),
        1.02,
    ),
}
ADJUST_LR = ("match_rms_adamw", "original", "none")
NS_DTYPES = ("auto", "float32", "bfloat16")
NS_COEFFS = tuple(NS_SCHEDULES)


def config_rules(m) -> list[tuple[str, object, bool, str]]:
    """config.py's value rules for `optim.muon` (`m`)."""
    return [
        ("optim.muon.lr_mult", m.lr_mult, number(m.lr_mult) > 0, "a number > 0"),
        ("optim.muon.adjust_lr", m.adjust_lr, m.adjust_lr in ADJUST_LR, " | ".join(ADJUST_LR)),
        ("optim.muon.momentum", m.momentum, 0 <= number(m.momentum) < 1, "a number in [0, 1), e.g. 0.95"),
        ("optim.muon.nesterov", m.nesterov, isinstance(m.nesterov, bool), "true or false"),
        ("optim.muon.ns_steps", m.ns_steps, is_int(m.ns_steps) and 1 <= m.ns_steps <= 20, "a whole number in 1..20"),
        ("optim.muon.ns_dtype", m.ns_dtype, m.ns_dtype in NS_DTYPES, " | ".join(NS_DTYPES)),
        ("optim.muon.ns_coeffs", m.ns_coeffs, m.ns_coeffs in NS_COEFFS, " | ".join(NS_COEFFS)),
    ]


def ns_dtype(choice: str, device: torch.device) -> torch.dtype:
    """`optim.muon.ns_dtype`: auto = bf16 on CUDA (tensor cores), fp32 elsewhere (CPU bf16 matmuls are ~25x slower)."""
    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, choice)


def ns_schedule(coeffs: str, steps: int) -> list[tuple[float, float, float]]:
    """(a, b, c) for each of `steps` iterations: the table's, its last entry repeated past its end."""
    table = NS_SCHEDULES[coeffs][0]
    return [table[min(i, len(table) - 1)] for i in range(steps)]


def orthogonalize(g: torch.Tensor, steps: int, dtype: torch.dtype, coeffs: str = "quintic") -> torch.Tensor:
    """An approximately semi-orthogonal matrix with g's singular vectors (a batch of them if g is 3-D)."""
    schedule, safety = ns_schedule(coeffs, steps), NS_SCHEDULES[coeffs][1]
    x = g.to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the short side: the Gram matrix is min(A, B) squared
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * safety + 1e-7)  # spectral norm <= Frobenius norm <= 1
    batched = x.dim() == 3
    x = x if batched else x.unsqueeze(0)
    # On a CPU in fp32 a wide matrix iterates on its Gram matrix: fewer FLOPs once B >= 2A. The Gram matrix
    # squares the condition number, which bf16, and TF32 (CUDA's fp32 matmuls in training, train.py), would
    # pay for in the small singular values: there the iteration stays on X.
    wide = x.size(-1) >= 2 * x.size(-2) and dtype in (torch.float32, torch.float64) and x.device.type == "cpu"
    x = (_iterate_gram if wide else _iterate)(x, schedule)
    x = x if batched else x.squeeze(0)
    return x.mT if tall else x


def _polynomial(gram: torch.Tensor, a: float, b: float, c: float) -> torch.Tensor:
    """a·I + b·G + c·G²: the scalings and sums act on the small Gram matrix, none on X (separate elementwise
    passes over X took a third of the iteration on a CPU; performance.md)."""
    poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
    poly.diagonal(dim1=-2, dim2=-1).add_(a)
    return poly


def _iterate(x: torch.Tensor, schedule: list) -> torch.Tensor:
    for a, b, c in schedule:  # X <- (a·I + b·G + c·G²)·X, G = XXᵀ: 2A²B + 2A³ + 2A²B FLOPs
        gram = torch.bmm(x, x.mT)
        x = torch.bmm(_polynomial(gram, a, b, c), x)
    return x


def _iterate_gram(x: torch.Tensor, schedule: list) -> torch.Tensor:
    """The same iterates as `_iterate`, as X_k = Q_k·X_0: every Q_k is a polynomial in G_0 = X_0X_0ᵀ, so they all
    commute and G_k = Q_k·G_0·Q_k. Four A×A products an iteration and two A×B ones in all, against
    two A×B products an iteration (for 4 × (128×512) and 5 steps: 0.66x the time, performance.md)."""
    g0 = torch.bmm(x, x.mT)
    gram, q = g0, None
    for i, (a, b, c) in enumerate(schedule):
        poly = _polynomial(gram, a, b, c)
        q = poly if q is None else torch.bmm(poly, q)
        if i + 1 < len(schedule):
            gram = torch.bmm(q, torch.bmm(q, g0))
    return torch.bmm(q, x)


def lr_ratio(rule: str, rows: int, cols: int) -> float:
    """How much a matrix's step is scaled. match_rms_adamw (Moonlight): 0.2·sqrt(max(A, B)) gives the update the
    RMS of a typical AdamW update, so Muon reuses AdamW's LR and weight decay; original (Keller Jordan):
    sqrt(max(1, A/B)), which wants an LR about 10x AdamW's; none: 1."""
    if rule == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    if rule == "original":
        return math.sqrt(max(1.0, rows / cols))
    return 1.0


class Muon(torch.optim.Optimizer):
    """Each param group is marked `muon: True` (2-D matrices; optionally `splits`, one entry per parameter: the
    row sizes orthogonalised apart, or None) or `muon: False` (AdamW). `defaults["fused"]` is True only when
    the AdamW groups are fused: then `found_inf` skips the whole step on the device (both kinds of group),
    and the stability suite may defer its host read."""

    def __init__(
        self,
        params,
        lr: float,
        *,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        ns_dtype: str = "auto",
        ns_coeffs: str = "quintic",
        adjust_lr: str = "match_rms_adamw",
        fused: bool = False,
    ):
        if adjust_lr not in ADJUST_LR or ns_dtype not in NS_DTYPES or ns_coeffs not in NS_COEFFS:
            raise ValueError(
                f"adjust_lr={adjust_lr!r} / ns_dtype={ns_dtype!r} / ns_coeffs={ns_coeffs!r}: "
                f"allowed {ADJUST_LR} / {NS_DTYPES} / {NS_COEFFS}"
            )
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_steps=ns_steps,
            ns_dtype=ns_dtype,
            ns_coeffs=ns_coeffs,
            adjust_lr=adjust_lr,
            fused=fused,
            muon=False,
            splits=None,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            if group["muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon groups take 2-D matrices only (put vectors and embeddings in AdamW groups)")

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # checkpoints from before `ns_coeffs` iterated Keller Jordan's quintic
            group.setdefault("ns_coeffs", "quintic")

    @torch.no_grad()
    def step(self, closure=None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = compat.read_found_inf(self)  # set by the stability suite (deferred mode)
        for group in self.param_groups:
            (self._muon_step if group["muon"] else self._adamw_step)(group, found_inf)
        return loss

    def _adamw_step(self, group: dict, found_inf: torch.Tensor | None) -> None:
        """torch's own AdamW (the same state layout and kernels as `torch.optim.AdamW`, so results are bitwise equal)."""
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        for p in params:
            state = self.state[p]
            if not state:
                # As torch.optim.Adam: the step count lives on the device when fused, on the host otherwise.
                device = p.device if group["fused"] else "cpu"
                state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        adamw(
            params,
            [p.grad for p in params],
            [s["exp_avg"] for s in states],
            [s["exp_avg_sq"] for s in states],
            [],
            [s["step"] for s in states],
            fused=group["fused"],
            found_inf=found_inf,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def _muon_step(self, group: dict, found_inf: torch.Tensor | None) -> None:
        lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        splits = group["splits"] or [None] * len(group["params"])
        splits = [rows for p, rows in zip(group["params"], splits) if p.grad is not None]
        new_bufs, parts = [], []
        for p, rows in zip(params, splits):
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            new_buf = state["momentum_buffer"].lerp(p.grad, 1 - mu)
            update = p.grad.lerp(new_buf, mu) if group["nesterov"] else new_buf
            if isinstance(update, DTensor):  # FSDP: each matrix orthogonalized whole, gathered on every rank
                update = update.full_tensor()
            new_bufs.append(new_buf)
            parts.append(update.split(rows) if rows else (update,))
        ortho = iter(self._orthogonalize_by_shape([x for ps in parts for x in ps], group, params[0].device))
        skip = found_inf.bool() if found_inf is not None else None
        for p, new_buf, ps in zip(params, new_bufs, parts):
            mine = [next(ortho) for _ in ps]
            step = torch.cat([o.to(p.dtype) * (lr * lr_ratio(group["adjust_lr"], *o.shape)) for o in mine])
            if isinstance(p, DTensor):  # this rank's rows of the whole matrix's step
                step = distribute_tensor(step, p.device_mesh, p.placements, src_data_rank=None)
            new_p = p.mul(1 - lr * wd).sub_(step)  # decoupled decay, with the unscaled LR
            buf = self.state[p]["momentum_buffer"]
            if skip is None:
                buf.copy_(new_buf)
                p.copy_(new_p)
            else:  # written in place: one pass each instead of a select and a copy
                torch.where(skip, buf, new_buf, out=buf)
                torch.where(skip, p, new_p, out=p)

    @staticmethod
    def _orthogonalize_by_shape(parts: list[torch.Tensor], group: dict, device: torch.device) -> list[torch.Tensor]:
        """Matrices of one shape (a tall one counts as its transpose) go through Newton-Schulz as one batch: a few
        large matmuls instead of many small ones (2 calls a step instead of 24 for 4 GPT-2 blocks)."""
        dtype = ns_dtype(group["ns_dtype"], device)
        wide = [x.mT if x.size(0) > x.size(1) else x for x in parts]
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, x in enumerate(wide):
            by_shape.setdefault(tuple(x.shape), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(parts)
        for idx in by_shape.values():
            batch = orthogonalize(torch.stack([wide[i] for i in idx]), group["ns_steps"], dtype, group["ns_coeffs"])
            for i, x in zip(idx, batch.unbind(0)):
                out[i] = x.mT if wide[i] is not parts[i] else x
        return out


def param_groups(net: torch.nn.Module, optim: dict) -> list[dict]:
    """AdamW groups first (decayed embeddings/head, undecayed norms and biases), then the Muon groups: every 2-D
    weight inside the blocks, with the fused qkv split into q, k, v and the SwiGLU `fc` into gate and up.
    Each group carries `lr_mult` and starts at optim.lr · lr_mult (the LR schedule scales from there)."""
    cfg, mult = net.cfg, float(optim["muon"]["lr_mult"])
    q, kv = cfg.n_head * cfg.head_dim, cfg.n_kv_head * cfg.head_dim
    fused_rows = {"attn.qkv.weight": (q, kv, kv)}
    if cfg.mlp == "swiglu":
        fused_rows["mlp.fc.weight"] = (cfg.hidden, cfg.hidden)
    adam_decay, adam_plain, muon, splits = [], [], [], []
    for name, p in net.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith("blocks.") and p.dim() == 2:
            muon.append(p)
            splits.append(next((rows for suffix, rows in fused_rows.items() if name.endswith(suffix)), None))
        else:
            (adam_decay if p.dim() >= 2 else adam_plain).append(p)
    lr, wd = optim["lr"], optim["weight_decay"]
    groups = [
        {"params": adam_decay, "weight_decay": wd, "muon": False, "lr": lr, "lr_mult": 1.0},
        {"params": adam_plain, "weight_decay": 0.0, "muon": False, "lr": lr, "lr_mult": 1.0},
    ]
    groups.append(
        {"params": muon, "weight_decay": wd, "muon": True, "splits": splits, "lr": lr * mult, "lr_mult": mult}
    )
    return groups
