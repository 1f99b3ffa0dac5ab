"""Model rows: one forward/backward of the real `GPT` at init, on a real batch when the data allows.

What a healthy init looks like: past logits do not depend on future tokens, the loss is about
ln(vocab) (near-uniform predictions), loss and every gradient are finite, the global grad norm and
the residual-stream RMS of every block sit in a sane band. Plus the parameter count and an estimate
of memory per device, so an out-of-memory shows up here rather than an hour into a queue.
"""

from __future__ import annotations

import math

import torch
from omegaconf import DictConfig

from steadylm.devices import devices_of
from steadylm.doctor.check import FAIL, OK, Check, guarded
from steadylm.doctor.config_checks import precision_of
from steadylm.doctor.coord_check import check_coords
from steadylm.memory import advice, plan
from steadylm.module import LMModule
from steadylm.stability.init_loss import INIT_OTHERWISE, init_fix

LEAK_TOL = 1e-4  # fp32 logits of the past may move by rounding only
INIT_LOSS_TOL = 1.0  # nats away from ln(vocab)
GRAD_NORM_MIN = 1e-3


def grad_norm_ceiling(d_model: int, n_layer: int) -> float:
    """The largest global grad norm a healthy init can have, derived from the model's shape.

    The output layer's gradient is an average over tokens of (softmax - one-hot) times the final
    normalised hidden state: the first has norm <= sqrt(2), the second norm sqrt(d) (unit RMS), so that
    gradient is at most sqrt(2·d). A healthy init gives no block a larger gradient than the head (residual
    writers are scaled down by depth), so the total stays within sqrt((n_layer + 1)·2·d). The bound grows
    with the model: GPT-2 124M measures ~53, under its ceiling of ~141; a fixed band would fail it.
    """
    return math.sqrt(2 * d_model * (n_layer + 1))


ACT_RMS_MAX, ACT_RMS_GROWTH = 100.0, 20.0


def check_causal(net: torch.nn.Module, x: torch.Tensor) -> list[Check]:
    """Change every token from the middle on; logits before the middle must not move."""
    name = "model: causal mask"
    cut = x.shape[1] // 2
    x2 = x.clone()
    x2[:, cut:] = (x2[:, cut:] + 1) % net.cfg.vocab_size
    net.eval()
    with torch.no_grad():
        leak = (net(x)[:, :cut] - net(x2)[:, :cut]).abs().max().item()
    if not leak <= LEAK_TOL:
        return [
            Check(
                name,
                FAIL,
                f"changing tokens {cut}.. moved the logits of positions 0..{cut - 1} by {leak:.3g}: "
                "attention sees the future",
                "use is_causal=True / a lower-triangular mask in attention",
            )
        ]
    return [Check(name, OK, f"logits of positions < {cut} unchanged (max diff {leak:.1e}) when later tokens change")]


def check_init_loss(module: LMModule, x: torch.Tensor, y: torch.Tensor) -> list[Check]:
    name = "model: initial loss"
    V = module.net.cfg.vocab_size
    module.eval()
    with torch.no_grad():
        loss = module.loss(module(x), y)[0].item()
    expect = math.log(V)
    evidence = f"loss {loss:.3f} vs ln({V}) = {expect:.3f}"
    if module.weights_from is not None:  # model.init_from: trained weights, no init to judge
        return [Check(name, OK, f"{evidence}: the weights of {module.weights_from}, not an init (nothing to judge)")]
    if not abs(loss - expect) <= INIT_LOSS_TOL:
        return [
            Check(
                name,
                FAIL,
                f"{evidence}: the initial predictions are far from uniform (over-confident logits)",
                init_fix(module.net.cfg.init, INIT_OTHERWISE),
            )
        ]
    return [Check(name, OK, evidence)]


def check_backward(module: LMModule, x: torch.Tensor, y: torch.Tensor) -> list[Check]:
    """One training forward/backward: finite loss and grads (naming the first bad one), grad norm band."""
    module.train()
    module.zero_grad(set_to_none=True)
    loss = module.loss(module(x), y)[0]
    loss.backward()
    params = list(module.net.named_parameters())
    grads = [(n, p.grad) for n, p in params if p.grad is not None]
    bad_weight = next((n for n, p in params if not torch.isfinite(p).all()), None)
    bad_grad = next((n for n, g in grads if not torch.isfinite(g).all()), None)
    if not torch.isfinite(loss) or bad_grad:
        # A non-finite weight is the cause when there is one; otherwise name the first bad gradient.
        where = (
            f"non-finite weight {bad_weight}"
            if bad_weight
            else f"first non-finite grad {bad_grad}"
            if bad_grad
            else "non-finite loss with finite weights"
        )
        return [
            Check(
                "model: finite forward/backward",
                FAIL,
                f"loss {loss.item():.4g}, {where}",
                "inspect that module's weights and init (debug=anomaly names the op)",
            )
        ]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for _, g in grads])).item()
    rows = [Check("model: finite forward/backward", OK, f"loss and all {len(grads)} gradients finite")]
    c = module.net.cfg
    lo, hi = GRAD_NORM_MIN, grad_norm_ceiling(c.d_model, c.n_layer)
    if not lo <= norm <= hi:
        rows.append(
            Check(
                "model: init grad norm",
                FAIL,
                f"global grad norm {norm:.3g} outside [{lo:g}, {hi:.3g}] at init",
                init_fix(
                    c.init,
                    "model.init is gpt2 already: look for weights changed after init, "
                    "or set optim.z_loss=1e-4 and model.qk_norm=true",
                ),
            )
        )
    else:
        rows.append(
            Check("model: init grad norm", OK, f"global grad norm {norm:.3g} (band [{lo:g}, {hi:.3g}] for this shape)")
        )
    module.zero_grad(set_to_none=True)
    return rows


def check_activations(net: torch.nn.Module, x: torch.Tensor) -> list[Check]:
    """RMS of the residual stream after each block: it must stay finite and not blow up with depth."""
    name = "model: activation RMS"
    rms: list[float] = []
    hooks = [
        b.register_forward_hook(lambda m, i, o: rms.append(o.float().pow(2).mean().sqrt().item())) for b in net.blocks
    ]
    net.eval()
    try:
        with torch.no_grad():
            net(x)
    finally:
        for h in hooks:
            h.remove()
    shown = ", ".join(f"{r:.3g}" for r in rms)
    growth = rms[-1] / max(rms[0], 1e-12)
    worst = max(range(len(rms)), key=lambda i: rms[i] if math.isfinite(rms[i]) else math.inf)
    if not all(math.isfinite(r) and r <= ACT_RMS_MAX for r in rms) or growth > ACT_RMS_GROWTH:
        return [
            Check(
                name,
                FAIL,
                f"block RMS [{shown}]: blocks.{worst} out of band (max {ACT_RMS_MAX:g}, growth "
                f"{growth:.3g}x > {ACT_RMS_GROWTH:g}x)",
                init_fix(net.cfg.init, "model.init is gpt2 already: look for weights changed after init"),
            )
        ]
    return [Check(name, OK, f"block RMS [{shown}]")]


def check_memory(cfg: DictConfig, n_params: int, batch_size: int) -> list[Check]:
    """The same estimate and verdict `train.py` refuses a run on (`steadylm.memory`), at the data's batch size."""
    precision, devices = precision_of(cfg), devices_of(cfg)
    p = plan(cfg, precision, devices, batch_size, n_params)
    evidence = f"{n_params / 1e6:.2f}M params; {p.describe()} at a batch of {batch_size}"
    if not p.fits:
        return [Check("model: size and memory", FAIL, evidence, advice(cfg, precision, devices, batch_size, n_params))]
    return [Check("model: size and memory", OK, evidence)]


def model_checks(cfg: DictConfig, batch: tuple[torch.Tensor, torch.Tensor] | None) -> list[Check]:
    torch.manual_seed(int(cfg.seed))
    module = LMModule(model=cfg.model, optim=cfg.optim)
    sequences = len(batch[0]) if batch is not None else cfg.data.get("batch_size", 2)  # the data's micro-batch
    if batch is None:  # the data rows already failed; a random batch still tests the model
        V, T = int(cfg.model.vocab_size), int(cfg.model.context_length)
        ids = torch.randint(0, V, (2, T + 1))
        batch = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    x, y = batch
    net = module.net
    rows = [
        Check(
            "model: build",
            OK,
            f"GPT n_layer={net.cfg.n_layer} n_head={net.cfg.n_head} d_model={net.cfg.d_model} "
            f"on a batch of {tuple(x.shape)}",
        )
    ]
    rows += guarded("model: causal mask", lambda: check_causal(net, x))
    rows += guarded("model: initial loss", lambda: check_init_loss(module, x, y))
    rows += guarded("model: finite forward/backward", lambda: check_backward(module, x, y))
    rows += guarded("model: activation RMS", lambda: check_activations(net, x))
    rows += guarded("model: size and memory", lambda: check_memory(cfg, net.num_params(non_embedding=False), sequences))
    rows += guarded("model: coordinate check", lambda: check_coords(cfg, batch))
    return rows
