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

from steadylm.doctor.check import FAIL, OK, Check, guarded
from steadylm.doctor.config_checks import on_gpu, precision_of
from steadylm.module import LMModule

LEAK_TOL = 1e-4  # fp32 logits of the past may move by rounding only
INIT_LOSS_TOL = 1.0  # nats away from ln(vocab)
GRAD_NORM_BAND = (1e-3, 50.0)
ACT_RMS_MAX, ACT_RMS_GROWTH = 100.0, 20.0
ADAMW_BYTES_PER_PARAM = 4 + 4 + 8  # fp32 weight, fp32 grad, two fp32 Adam moments


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
        return [Check(name, FAIL, f"changing tokens {cut}.. moved the logits of positions 0..{cut - 1} by {leak:.3g}: "
                                  "attention sees the future", "use is_causal=True / a lower-triangular mask in attention")]
    return [Check(name, OK, f"logits of positions < {cut} unchanged (max diff {leak:.1e}) when later tokens change")]


def check_init_loss(module: LMModule, x: torch.Tensor, y: torch.Tensor) -> list[Check]:
    name = "model: initial loss"
    V = module.net.cfg.vocab_size
    module.eval()
    with torch.no_grad():
        loss = module.loss(module(x), y)[0].item()
    expect = math.log(V)
    evidence = f"loss {loss:.3f} vs ln({V}) = {expect:.3f}"
    if not abs(loss - expect) <= INIT_LOSS_TOL:
        return [Check(name, FAIL, f"{evidence}: the initial predictions are far from uniform (over-confident logits)",
                      "use model.init=gpt2 (N(0, 0.02), scaled residual projections)")]
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
        where = (f"non-finite weight {bad_weight}" if bad_weight
                 else f"first non-finite grad {bad_grad}" if bad_grad else "non-finite loss with finite weights")
        return [Check("model: finite forward/backward", FAIL, f"loss {loss.item():.4g}, {where}",
                      "inspect that module's weights and init (debug=anomaly names the op)")]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for _, g in grads])).item()
    rows = [Check("model: finite forward/backward", OK, f"loss and all {len(grads)} gradients finite")]
    lo, hi = GRAD_NORM_BAND
    if not lo <= norm <= hi:
        rows.append(Check("model: init grad norm", FAIL, f"global grad norm {norm:.3g} outside [{lo:g}, {hi:g}] at init",
                          "use model.init=gpt2 and check the loss scale (z_loss, vocab)"))
    else:
        rows.append(Check("model: init grad norm", OK, f"global grad norm {norm:.3g} (band [{lo:g}, {hi:g}])"))
    module.zero_grad(set_to_none=True)
    return rows


def check_activations(net: torch.nn.Module, x: torch.Tensor) -> list[Check]:
    """RMS of the residual stream after each block: it must stay finite and not blow up with depth."""
    name = "model: activation RMS"
    rms: list[float] = []
    hooks = [b.register_forward_hook(lambda m, i, o: rms.append(o.float().pow(2).mean().sqrt().item())) for b in net.blocks]
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
        return [Check(name, FAIL, f"block RMS [{shown}]: blocks.{worst} out of band (max {ACT_RMS_MAX:g}, growth "
                                  f"{growth:.3g}x > {ACT_RMS_GROWTH:g}x)", "use model.init=gpt2 (scaled residual init)")]
    return [Check(name, OK, f"block RMS [{shown}]")]


def memory_estimate(cfg: DictConfig, n_params: int) -> dict[str, int]:
    """Bytes per device for plain DDP (every rank holds the whole model and optimizer).

    Activations follow Korthikanti et al. (2022): ~34·d 16-bit values per token per layer with a
    fused attention kernel (no T×T scores), doubled in fp32; plus fp32 logits and their gradient.
    """
    m = cfg.model
    elem = 4 if precision_of(cfg).startswith("32") else 8 if precision_of(cfg).startswith("64") else 2
    tokens = int(cfg.data.batch_size) * int(m.context_length)
    return {
        "weights+grads+adamw": n_params * ADAMW_BYTES_PER_PARAM,
        "activations": tokens * int(m.n_layer) * 34 * int(m.d_model) * elem // 2,
        "logits": tokens * int(m.vocab_size) * (elem + 8),
    }


def check_memory(cfg: DictConfig, n_params: int) -> list[Check]:
    name = "model: size and memory"
    parts = memory_estimate(cfg, n_params)
    total = sum(parts.values())
    gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
    evidence = f"{n_params / 1e6:.2f}M params; ~{gib(total)} per device (" + ", ".join(
        f"{k} {gib(v)}" for k, v in parts.items()) + f") at data.batch_size={cfg.data.batch_size}"
    if on_gpu(cfg):
        have = torch.cuda.get_device_properties(0).total_memory
        if total > 0.9 * have:
            return [Check(name, FAIL, f"{evidence} > 90% of {gib(have)} on {torch.cuda.get_device_name(0)}",
                          "lower data.batch_size and raise trainer.accumulate_grad_batches, or use a smaller model")]
        evidence += f" of {gib(have)}"
    return [Check(name, OK, evidence)]


def model_checks(cfg: DictConfig, batch: tuple[torch.Tensor, torch.Tensor] | None) -> list[Check]:
    torch.manual_seed(int(cfg.seed))
    module = LMModule(model=cfg.model, optim=cfg.optim)
    if batch is None:  # the data rows already failed; a random batch still tests the model
        V, T = int(cfg.model.vocab_size), int(cfg.model.context_length)
        ids = torch.randint(0, V, (2, T + 1))
        batch = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    x, y = batch
    net = module.net
    rows = [Check("model: build", OK, f"GPT n_layer={net.cfg.n_layer} n_head={net.cfg.n_head} d_model={net.cfg.d_model} "
                                      f"on a batch of {tuple(x.shape)}")]
    rows += guarded("model: causal mask", lambda: check_causal(net, x))
    rows += guarded("model: initial loss", lambda: check_init_loss(module, x, y))
    rows += guarded("model: finite forward/backward", lambda: check_backward(module, x, y))
    rows += guarded("model: activation RMS", lambda: check_activations(net, x))
    rows += guarded("model: size and memory", lambda: check_memory(cfg, net.num_params(non_embedding=False)))
    return rows
