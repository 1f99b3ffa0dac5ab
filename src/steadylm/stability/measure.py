"""The one per-optimizer-step measurement: loss, pre-clip grad norm and every check's values, all-reduced once.

One reduced value for all, so every rank decides alike and none waits alone in a collective. Deferred (with a
fused optimizer and no fp16 scaler) the host reads it a step late, so the CPU never waits for the GPU; a
non-finite step is still skipped on the device, through the optimizer's `found_inf` (as GradScaler does).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import torch

from steadylm.compat import FOUND_INF, clear_found_inf, set_found_inf
from steadylm.distributed import is_sharded
from steadylm.errors import ConfigError
from steadylm.stability.check import OPS


@dataclass(frozen=True)
class Measurement:
    step: int
    loss: float  # mean over micro-batches and ranks
    grad_norm: float  # pre-clip global L2 norm of the (already DDP-averaged) gradients
    loss_nonfinite: bool  # on any rank, in any micro-batch
    grad_nonfinite: bool
    batch_idx: tuple[int, ...] = ()  # the step's micro-batches, as the epoch's batch indices
    values: dict = field(default_factory=dict)  # {check name: {key: reduced value}}: what the checks measured
    batches: list = field(default_factory=list, compare=False, repr=False)  # references, for the forensic re-run
    bad_params: tuple[str, ...] = field(default=(), compare=False)  # parameters with a non-finite grad (this rank)

    @property
    def nonfinite(self) -> bool:
        return self.loss_nonfinite or self.grad_nonfinite

    def read(self) -> Measurement:
        """Already on the host (`StepMeasure.pending` restored from a checkpoint)."""
        return self

    def state(self) -> dict:
        """The numbers (not the batches' references), for a checkpoint."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.compare}

    @classmethod
    def from_state(cls, state: dict) -> Measurement:
        return cls(**{**state, "batch_idx": tuple(state["batch_idx"]), "values": state.get("values", {})})


def loss_scaler(trainer: Any) -> Any:
    """The fp16 GradScaler when training under `16-mixed`, else None."""
    return getattr(trainer.precision_plugin, "scaler", None)


class Packed:
    """One rank's share of a step's collective: [loss, grad norm, the "mean" and "norm" values] summed, the "max"
    values maxed; `reduced[check][key]`: each "max" value, a view the all-reduce fills, on the device. Sharded, a
    norm travels as its square: the global norm of slices is the root of the sum."""

    def __init__(self, loss: torch.Tensor, norm: torch.Tensor, values: dict[str, dict], sharded: bool) -> None:
        self.sharded = sharded
        self.keys: dict[str, list[tuple[str, str, tuple, str]]] = {"sum": [], "max": []}  # (check, key, shape, op)
        core = torch.stack([loss.float(), (norm.square() if sharded else norm).float()])
        parts: dict[str, list[torch.Tensor]] = {"sum": [core], "max": []}
        for name, measured in values.items():
            for key, (op, t) in measured.items():
                if op not in OPS:
                    raise ConfigError(f"check {name!r} measured {key!r} with op {op!r}; use one of {', '.join(OPS)}")
                shape, t = tuple(t.shape), t.detach().float().reshape(-1)
                where = "max" if op == "max" else "sum"
                self.keys[where].append((name, key, shape, op))
                parts[where].append(t.square() if op == "norm" and sharded else t)
        self.sums = torch.cat(parts["sum"]) if len(parts["sum"]) > 1 else core
        self.maxes = torch.cat(parts["max"]) if parts["max"] else None
        self.reduced: dict[str, dict[str, torch.Tensor]] = {}
        sizes = [math.prod(shape) for _, _, shape, _ in self.keys["max"]]
        for (name, key, shape, _), part in zip(self.keys["max"], self.maxes.split(sizes) if sizes else ()):
            self.reduced.setdefault(name, {})[key] = part.view(shape)

    def value(self, summed: np.ndarray, op: str, world: int) -> np.ndarray:
        """A value as the host reads it after the all-reduce."""
        if op == "max":
            return summed
        return np.sqrt(summed) if op == "norm" and self.sharded else summed / world

    def all_reduce(self) -> None:
        # Not `strategy.reduce`: its barrier makes the host wait every step. A non-finite term makes the sum so.
        torch.distributed.all_reduce(self.sums)
        if self.maxes is not None:
            torch.distributed.all_reduce(self.maxes, op=torch.distributed.ReduceOp.MAX)


class InFlight:
    """One step's reduced values on their way to the host, and the per-parameter norms (on the device)."""

    def __init__(self, step: int, packed: Packed, norms, params: list, net, world: int, batches, batch_idx) -> None:
        self.step, self.packed, self.norms, self.params, self.net, self.world = step, packed, norms, params, net, world
        self.batches, self.batch_idx = batches, tuple(batch_idx)
        flat = packed.sums if packed.maxes is None else torch.cat([packed.sums, packed.maxes])  # reduced already
        self.host = flat.to("cpu", non_blocking=True)  # on a GPU pinned, asynchronous; the event marks its arrival
        self.event = torch.cuda.Event() if flat.is_cuda else None
        if self.event is not None:
            self.event.record()
        self._read: Measurement | None = None

    def read(self) -> Measurement:
        """The reduced numbers as a `Measurement`, each check's values in their measured shape (nested lists)."""
        if self._read is not None:
            return self._read
        if self.event is not None:
            self.event.synchronize()
        host, world, packed = self.host.numpy().astype(np.float64), self.world, self.packed
        loss, norm = float(host[0]) / world, float(host[1])
        norm = math.sqrt(norm) if packed.sharded else norm / world  # replicated: every rank held the same norm
        values: dict[str, dict] = {}
        at = 2
        for where in ("sum", "max"):
            for name, key, shape, op in packed.keys[where]:
                n = math.prod(shape)
                got = packed.value(host[at : at + n], op, world)
                values.setdefault(name, {})[key] = got.reshape(shape).tolist()
                at += n
        bad = ()
        if not math.isfinite(norm) and self.norms is not None:  # the failure path: a host sync here is fine
            names = {id(p): n for n, p in self.net.named_parameters()}
            bad = tuple(names.get(id(self.params[i]), "?") for i in (~self.norms.isfinite()).nonzero().view(-1))
        inf_loss, inf_norm = not math.isfinite(loss), not math.isfinite(norm)
        self._read = Measurement(self.step, loss, norm, inf_loss, inf_norm, self.batch_idx, values, self.batches, bad)
        return self._read


class StepMeasure:
    """A step's micro-batch losses and batches (the owner appends them), measured once per step (`take`)."""

    def __init__(self, defer: bool = True) -> None:
        self.allow_defer = defer
        self.deferred: bool | None = None  # decided at the first step
        self.losses: list[torch.Tensor] = []
        self.token_losses: list[torch.Tensor] = []  # per micro-batch, when a check asks (`Check.wants_token_losses`)
        self.batches: list = []  # this step's micro-batches (references; for the forensic re-run)
        self.batch_idx: list[int] = []
        self.taken = True  # the next micro-batch starts a new step
        self.current: InFlight | None = None  # the step under way, measured
        self.pending: InFlight | Measurement | None = None  # deferred: the last step's, read at the next one
        self.skip_flag: torch.Tensor | None = None  # deferred: the optimizers' skip flag

    def take(self, trainer, pl_module, view, checks=()) -> Measurement | None:
        """Measure the step under way with `checks`' own values; return the measurement to act on now: this
        step's, or (deferred) the previous step's, or None."""
        if self.deferred is None:  # the device can skip a non-finite step by itself: fused, and no fp16 scaler
            fused = all(opt.defaults.get("fused") for opt in trainer.optimizers)
            self.deferred = self.allow_defer and fused and loss_scaler(trainer) is None
        self.taken = True
        device = pl_module.device
        # Lightning hands the hooks loss / accumulate_grad_batches: the sum is the step's mean loss.
        loss = torch.stack(self.losses).detach().float().sum() if self.losses else torch.zeros((), device=device)
        self.losses = []  # they hold the autograd graph; every micro-batch of this step has been seen
        if view.loss_scale is not None:
            loss = loss / view.loss_scale  # the fp16 hook sees the scaled loss
        norms, with_grad = pl_module.grad_norms()  # clipping reuses them instead of walking every gradient again
        norm = torch.linalg.vector_norm(norms) if norms is not None else torch.zeros((), device=device)
        world = trainer.world_size
        # FSDP: each rank holds a slice, the global norm is the root of the summed squares; DDP: sum / world.
        sharded = is_sharded(trainer.strategy)
        packed = Packed(loss, norm, {c.name: c.measure(view) for c in checks}, sharded)
        if world > 1 and torch.distributed.is_initialized():
            packed.all_reduce()
        if sharded and hasattr(pl_module, "set_sharded_grad_norm"):  # clipping reuses the global norm (a device value)
            pl_module.set_sharded_grad_norm(packed.sums[1].sqrt())
        if self.deferred:  # the optimizers skip the whole update on the device while the flag is 1: no host read
            if self.skip_flag is None:
                self.skip_flag = torch.zeros((), device=packed.sums.device)
            self.skip_flag.copy_(~packed.sums[:2].isfinite().all())  # loss or grad norm, on any rank
            for opt in trainer.optimizers:
                if vars(opt).get(FOUND_INF) is not self.skip_flag:  # once a fit: the flag is written in place
                    set_found_inf(opt, self.skip_flag)
        net = getattr(pl_module, "net", pl_module)
        self.current = InFlight(view.step, packed, norms, with_grad, net, world, list(self.batches), self.batch_idx)
        if not self.deferred:
            return self.current.read()
        due, self.pending = self.pending, self.current
        return due.read() if due is not None else None

    def abandon(self) -> None:
        """The step under way reaches neither the weights nor a later check (rollback, stop)."""
        if self.pending is self.current:
            self.pending = None
        self.current = None

    def finish(self, trainer) -> None:
        self.skip_flag = None
        for opt in trainer.optimizers:
            clear_found_inf(opt)

    def state_dict(self) -> dict:
        """The measurement not yet acted on travels in the checkpoint: a resumed run acts on it as this one would."""
        return {"pending": self.pending.read().state() if self.pending is not None else None}

    def load_state_dict(self, state: dict | None) -> None:
        pending = (state or {}).get("pending")
        if pending:
            self.pending = Measurement.from_state(pending)
