"""The evidence of a non-finite step (the first module that went non-finite), and what a stop leaves behind: the
forensic bundle and the checkpoints of the diverged and the last good state.

`locate` re-runs this step's micro-batches through the bare model (never the DDP wrapper, so no
collective runs and `.grad` is untouched) with forward and backward hooks on every leaf module, and
records the first non-finite output in forward order and the first non-finite gradient in backward
order, plus per-layer statistics. It runs only on the failure path; its host syncs do not matter there.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from steadylm.distributed import reshard
from steadylm.stability.events import stability_dir
from steadylm.stability.recovery import restore_weights_and_optimizer
from steadylm.stability.rollback import checkpoint_dir


def module_of(param_name: str | None) -> str | None:
    """`blocks.0.attn.qkv.weight` -> `blocks.0.attn.qkv`."""
    if param_name is None:
        return None
    return param_name.rsplit(".", 1)[0] if "." in param_name else param_name


def locate(pl_module, batches: list) -> dict:
    """Re-run `batches` with hooks; returns {"forward": name|None, "backward": name|None, "layers": {...}}."""
    net = pl_module.net
    leaves = [(n or "net", m) for n, m in net.named_modules() if not list(m.children())]
    layers: dict[str, dict] = {}
    order: dict[str, list[str]] = {"forward": [], "backward": []}

    def fwd_hook(name):
        def hook(module, args, out):
            if isinstance(out, torch.Tensor):
                o = out.detach().float()
                finite = o.isfinite()
                fin = o[finite]
                layers.setdefault(name, {}).update(
                    out_nonfinite=int((~finite).sum()),
                    out_absmax=float(fin.abs().max()) if fin.numel() else None,
                    out_rms=float(fin.pow(2).mean().sqrt()) if fin.numel() else None,
                )
                if not finite.all():
                    order["forward"].append(name)

        return hook

    def bwd_hook(name):
        def hook(module, grad_input, grad_output):
            g = grad_output[0]
            if g is not None:
                bad = int((~g.isfinite()).sum())
                layers.setdefault(name, {})["grad_nonfinite"] = bad
                if bad:
                    order["backward"].append(name)

        return hook

    handles = []
    for name, m in leaves:
        handles.append(m.register_forward_hook(fwd_hook(name)))
        handles.append(m.register_full_backward_hook(bwd_hook(name)))
    params = [p for p in net.parameters() if p.requires_grad]
    try:
        with torch.enable_grad(), warnings.catch_warnings():
            # The embedding's input is token ids, which need no grad; torch warns about that on every re-run.
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            for x, y in batches:
                loss, _ = pl_module.loss(net(x), y)
                torch.autograd.grad(loss, params, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
        reshard(net)
    for n, p in net.named_parameters():
        if not p.isfinite().all():
            layers.setdefault(module_of(n), {})["param_nonfinite"] = True
    first = lambda key: order[key][0] if order[key] else None  # noqa: E731
    return {"forward": first("forward"), "backward": first("backward"), "layers": layers}


TRANSIENT = "transient: not reproduced on re-run"


def _gather(obj) -> list:
    """`obj` from every rank (the failure path: an object collective is fine here)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        out = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def name_culprit(trainer, pl_module, m) -> tuple[str | None, str, dict]:
    """(module or None, the evidence, this rank's re-run report) for a non-finite measurement `m`.

    Only what was observed is named: the first non-finite output when the re-run of the step's batch
    reproduces it (forward order: where the NaN was born; then backward order), on whichever rank saw it;
    else the module of the non-finite gradients when they all belong to one module (an observed gradient
    fault); else no module at all. Every rank must call it (one object all-gather).
    """
    report = locate(pl_module, m.batches) if m.batches else {"forward": None, "backward": None, "layers": {}}
    found = report.get("forward") or report.get("backward")
    how = "output" if report.get("forward") else "gradient"
    modules = sorted({module_of(p) for p in m.bad_params})
    views = _gather((found, how, modules, bool(m.batches)))
    for rank, (f, kind, _, _) in enumerate(views):
        if f:
            return f, f"re-run of the step's batch on rank {rank}: first non-finite {kind} in {f}", report
    bad = sorted({mod for _, _, mods, _ in views for mod in mods})
    rerun = all(kept for *_, kept in views)
    if len(bad) == 1:
        what = "the re-run of the step's batch was finite" if rerun else "the batch was not kept (resumed run)"
        return bad[0], f"only {bad[0]} had a non-finite gradient; {what}", report
    if not rerun:
        return None, "not re-run (the batch was not kept: resumed run); no module observed", report
    return None, TRANSIENT, report


def write_bundle(trainer, step: int, bundle: dict) -> Path | None:
    if not trainer.is_global_zero:
        return None
    path = stability_dir(trainer) / "forensics" / f"step_{step}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(bundle, indent=1))
    return path


def stop_bundle(trainer, pl_module, m, v, detail: dict, first_module: str | None) -> dict:
    """Write the bundle of a non-finite stop (`stability/forensics/step_N.json`); what the stop event says of it.
    `first_module`: the module named at the start of the streak."""
    module, evidence, report = name_culprit(trainer, pl_module, m)
    bundle = {
        "step": m.step,
        "streak_start": v.onset,
        "kind": v.kind,
        "module": module or first_module,
        "evidence": evidence,
        "first_module": first_module,
        "batch": detail.get("batch"),
        "rank": trainer.global_rank,
        **report,
    }
    path = write_bundle(trainer, m.step, bundle)
    return {"module": first_module or module, "consecutive": detail.get("consecutive"), "forensics": path and str(path)}


def save_stop_checkpoints(trainer, pl_module, recovery) -> dict:
    """`diverged.ckpt` (the state now) beside `last_good.ckpt` (`recovery`'s newest known-good snapshot); every
    rank calls it: saving is collective."""
    folder = checkpoint_dir(trainer)
    out = {}
    try:
        trainer.save_checkpoint(folder / "diverged.ckpt")
        out["broken_checkpoint"] = str(folder / "diverged.ckpt")
        snap = recovery.newest_good()
        if snap is not None:
            restore_weights_and_optimizer(trainer, pl_module, snap)
            pl_module.continue_from(snap.applied, trainer.global_step)
            trainer.save_checkpoint(folder / "last_good.ckpt")
            out.update(last_good_checkpoint=str(folder / "last_good.ckpt"), last_good_step=snap.step)
    except Exception as err:  # the stop itself must happen even when the disk is full
        out["checkpoint_error"] = f"{type(err).__name__}: {err}"
    return out
