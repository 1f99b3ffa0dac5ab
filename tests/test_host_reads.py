"""An ordinary optimizer step reads no tensor on the host: the guard, on the CPU, and the guard failing when it should.

On a GPU each host read of a device tensor (`.item()`, `bool()`, `float()`, `.tolist()`, `.cpu()`, `.numpy()`, an
`if tensor:` branch, `nonzero`) makes the CPU wait for the device. A CPU has nothing to wait for, so counting CUDA
synchronisations there proves nothing; instead a `TorchFunctionMode`, live for a whole real fit, records every such
call whose caller (the first frame outside torch) is in the watched code, and the steps it happened on.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.overrides import TorchFunctionMode

from steadylm.stability.check import Check
from steadylm.stability.verdict import OK
from steadylm.train import build

SRC = str(Path(__file__).resolve().parents[1] / "src" / "steadylm")
TORCH = str(Path(torch.__file__).parent)
READS = {"item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__float__", "__int__", "__index__", "__format__"}
READS |= {"__array__"}
# Host reads steadylm makes on an ordinary step by design, each of a tensor that is already on the host.
HOST_SIDE = {
    ("sampler.py", "__iter__"),  # the epoch's permutation, drawn on the CPU
    ("measure.py", "read"),  # the measurement's host copy, sent non-blocking a step earlier
    ("qk_clip.py", "verdict"),  # a tensor built from that host copy's per-head logits
}
EVERY = 10  # logging, stats, checkpoint and snapshot interval of the guarded fit


def _is_read(func, args, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    if name in READS:
        return True
    if name == "to" and not kwargs.get("non_blocking"):  # `.to("cpu")` waits; a non-blocking copy does not
        device = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
        return device is not None and torch.device(device).type == "cpu" and args[0].device.type != "cpu"
    return False


class HostReads(TorchFunctionMode):
    """Records (step, file, function, line, read) for each host read made by `watch`ed code while `step` is set."""

    def __init__(self, watch: tuple[str, ...]) -> None:
        super().__init__()
        self.watch, self.step, self.sites = watch, None, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.step is not None and _is_read(func, args, kwargs):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(self.watch):
                code = frame.f_code
                self.sites.append((self.step, Path(code.co_filename).name, code.co_name, frame.f_lineno, func.__name__))
        return func(*args, **kwargs)


class Clock(L.Callback):
    def __init__(self, mode: HostReads) -> None:
        self.mode = mode

    def on_train_batch_start(self, trainer, *args) -> None:
        self.mode.step = trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        self.mode.step = None


def host_reads(make_cfg, *overrides: str, watch: tuple[str, ...] = (SRC,)) -> tuple[list, list]:
    """A real 40-step fit under the guard: (reads on ordinary steps not in `HOST_SIDE`, every read seen). Ordinary:
    no logging, stats, checkpoint or snapshot falls on it; the console lines on, as in a user's run."""
    cfg = make_cfg(
        "trainer.max_steps=40",
        f"trainer.log_every_n_steps={EVERY}",
        f"callbacks.checkpoint.every_n_train_steps={EVERY}",
        f"callbacks.stability.recovery.every_n_steps={EVERY}",
        "trainer.limit_val_batches=0",
        "trainer.enable_progress_bar=true",
        *overrides,
    )
    objs = build(cfg)
    mode = HostReads(watch)
    objs["trainer"].callbacks.insert(0, Clock(mode))
    with mode:
        objs["trainer"].fit(objs["module"], datamodule=objs["datamodule"])
    ordinary = [s for s in mode.sites if (s[0] + 1) % EVERY and s[0] % EVERY and s[1:3] not in HOST_SIDE]
    return ordinary, mode.sites


def test_no_steadylm_code_reads_a_tensor_on_the_host_on_an_ordinary_step(make_cfg):
    ordinary, seen = host_reads(make_cfg)
    assert ordinary == [], "host reads on ordinary steps (step, file, function, line, read):\n" + "\n".join(
        map(str, ordinary)
    )
    # the guard is live: the logging steps read their numbers, where that is allowed
    assert {(f, fn) for s, f, fn, *_ in seen if (s + 1) % EVERY == 0} - HOST_SIDE


class ReadsOnEveryStep(Check):
    """A check with a host read a forker might add by mistake; `how` picks the read."""

    def __init__(self, how: str = "item") -> None:
        self.how = how

    def measure(self, view) -> dict:
        z = view.module.log_z  # this step's mean log Z, a device tensor
        if self.how == "item":
            z.item()
        elif self.how == "branch":
            if z > 0:  # a data-dependent branch: `bool()` of a device value
                pass
        elif self.how == "float":
            float(z)
        elif self.how == "tolist":
            z.view(1).tolist()
        elif self.how == "cpu":
            z.cpu()
        return {}

    def verdict(self, m, view):
        return OK


@pytest.mark.parametrize("how", ["item", "branch", "float", "tolist", "cpu"])
def test_the_guard_fails_on_a_host_read_added_to_the_step(make_cfg, how):
    check = f"+callbacks.stability.checks.reads={{_target_: tests.test_host_reads.ReadsOnEveryStep, how: {how}}}"
    ordinary, _ = host_reads(make_cfg, check, watch=(SRC, __file__))
    here = {(f, fn) for _, f, fn, *_ in ordinary}
    assert here == {("test_host_reads.py", "measure")}, ordinary
    assert len({s for s, *_ in ordinary}) == 40 - 8  # every ordinary step: 40 less 4 logging and 4 snapshot steps
