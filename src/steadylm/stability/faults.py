"""`FaultInjector`: deliberately break a run at a chosen step, for the divergence presets and tests.

Config-driven list of faults, each `{kind, step, ...}`:

| kind | effect at optimizer step `step` |
| --- | --- |
| `nan_weight` | writes NaN into one element of parameter `param` (e.g. `blocks.1.mlp.fc.weight`) |
| `inf_grad` | puts +inf into one element of `param`'s gradient, after backward (and after DDP's all-reduce) |
| `corrupt_labels` | replaces the batch's labels with random tokens |
| `lr_spike` | multiplies the LR scale (hence every group's LR) by `factor` (default 1000) for that one step |
| `nan_loss` | makes the model's output (hence the loss) NaN |
| `nan_activation` | makes module `module`'s output (e.g. `blocks.1.mlp`) NaN in that step's first forward only: a transient |
| `loss_scale` | sets the fp16 loss scale to `value` (e.g. 2**40: every step overflows until it falls) |

`rank` (optional) limits a fault to one global rank. Parameter names are relative to the GPT (`net`).
It exists only to prove the stability suite catches each cause; it must never be on in a real run.
"""

from __future__ import annotations

import lightning as L
import torch

from steadylm.compat import set_loss_scale
from steadylm.distributed import local
from steadylm.errors import ConfigError

KINDS = ("nan_weight", "inf_grad", "corrupt_labels", "lr_spike", "nan_loss", "nan_activation", "loss_scale")


class FaultInjector(L.Callback):
    def __init__(self, faults: list[dict]) -> None:
        self.faults = [dict(f) for f in faults]
        for i, f in enumerate(self.faults):
            if f.get("kind") not in KINDS:
                raise ConfigError(
                    f"callbacks.faults.faults[{i}].kind={f.get('kind')!r} is not one of {', '.join(KINDS)}"
                )
            if "step" not in f:
                raise ConfigError(f"callbacks.faults.faults[{i}] needs a `step`")
        self._handle = None

    def _due(self, trainer, kind: str, step: int | None = None) -> list[dict]:
        step = trainer.global_step if step is None else step
        return [
            f
            for f in self.faults
            if f["kind"] == kind and f["step"] == step and f.get("rank", trainer.global_rank) == trainer.global_rank
        ]

    def _due_before_step(self, trainer, kind: str) -> list[dict]:
        """At batch end the step counter has moved on: the faults of the step just done."""
        return self._due(trainer, kind, trainer.global_step - 1)

    def _param(self, pl_module, name: str) -> torch.nn.Parameter:
        params = dict(pl_module.net.named_parameters())
        if name not in params:
            raise ConfigError(f"fault param {name!r} is not a parameter of the model; e.g. {next(iter(params))}")
        return params[name]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        for f in self._due(trainer, "nan_weight"):
            with torch.no_grad():
                local(self._param(pl_module, f["param"])).view(-1)[0] = float("nan")  # FSDP: each rank's slice
        for f in self._due(trainer, "corrupt_labels"):
            y = batch[1]
            g = torch.Generator().manual_seed(int(f.get("seed", 0)))
            y.copy_(torch.randint(0, pl_module.net.cfg.vocab_size, y.shape, generator=g).to(y.device))
        for _ in self._due(trainer, "nan_loss"):
            if self._handle is None:
                self._handle = pl_module.net.register_forward_hook(lambda m, a, out: out * float("nan"))
        for f in self._due(trainer, "nan_activation"):
            modules = dict(pl_module.net.named_modules())
            if f.get("module") not in modules:
                raise ConfigError(f"fault module {f.get('module')!r} is not a module of the model; e.g. blocks.0.mlp")
            handle = []

            def once(m, a, out, handle=handle):
                handle[0].remove()  # one forward only: a re-run of the batch is finite
                return out * float("nan")

            handle.append(modules[f["module"]].register_forward_hook(once))
        for f in self._due(trainer, "loss_scale"):
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            if scaler is None:
                raise ConfigError("fault loss_scale needs trainer.precision=16-mixed (a loss scaler)")
            set_loss_scale(scaler, float(f["value"]))

    def on_after_backward(self, trainer, pl_module) -> None:
        for f in self._due(trainer, "inf_grad"):
            grad = self._param(pl_module, f["param"]).grad
            if grad is not None:
                local(grad).view(-1)[0] = float("inf")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        for f in self._due(trainer, "lr_spike"):  # the module sets the LR from the scale after every callback
            pl_module.scale_lr(float(f.get("factor", 1000.0)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        for f in self._due_before_step(trainer, "lr_spike"):
            pl_module.scale_lr(1 / float(f.get("factor", 1000.0)))
        if self._handle is not None and not self._due(trainer, "nan_loss"):
            self._handle.remove()
            self._handle = None
