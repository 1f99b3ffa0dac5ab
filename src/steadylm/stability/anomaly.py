"""`AnomalyHooks` (`debug=anomaly`): stop at the first module whose output or gradient is non-finite.

Registers a forward hook and a full backward hook on every module of the model; each checks its
tensors and raises `NonFiniteError` naming the module and the step. Together with the Trainer's
`detect_anomaly` (torch.autograd anomaly mode) this is a debugging tool: every check is a host sync,
so a step runs ~2-3x slower. Never leave it on for a real run, and do not use it under DDP (it raises
on one rank).
"""

from __future__ import annotations

import lightning as L
import torch

from steadylm.errors import SteadyError


class NonFiniteError(SteadyError):
    """A module produced a non-finite output or gradient (anomaly mode)."""


def _first_bad(tensors) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_floating_point() and not t.isfinite().all() for t in tensors)


class AnomalyHooks(L.Callback):
    def __init__(self) -> None:
        self._handles: list = []

    def on_fit_start(self, trainer, pl_module) -> None:
        def forward_hook(name):
            def hook(module, args, out):
                if _first_bad(out if isinstance(out, (tuple, list)) else (out,)):
                    raise NonFiniteError(
                        f"non-finite output in module {name} at step {trainer.global_step} (debug=anomaly); "
                        "check its weights and inputs, or lower optim.lr"
                    )

            return hook

        def backward_hook(name):
            def hook(module, grad_input, grad_output):
                if _first_bad(grad_input):
                    raise NonFiniteError(
                        f"non-finite gradient in module {name} at step {trainer.global_step} (debug=anomaly); "
                        "lower optim.lr or enable trainer.gradient_clip_val"
                    )

            return hook

        for name, module in pl_module.net.named_modules():
            name = name or "net"
            self._handles.append(module.register_forward_hook(forward_hook(name)))
            if not list(module.children()):
                self._handles.append(module.register_full_backward_hook(backward_hook(name)))

    def on_fit_end(self, trainer, pl_module) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
