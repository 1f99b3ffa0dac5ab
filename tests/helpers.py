"""What several test files share: tiny overrides, a real `python train.py` subprocess, fault injection, an
in-process fit with extra callbacks, and callbacks that record the truth a test compares against."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import lightning as L
import numpy as np
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from steadylm.module import LMModule
from steadylm.train import build

ROOT = Path(__file__).resolve().parents[1]

# A 1-layer model that trains a few steps in seconds, for runs through the real command line.
CLI_TINY = [
    "model.n_layer=1",
    "model.d_model=32",
    "model.n_head=2",
    "model.mup_base_width=32",  # based at itself: mup is sp bit for bit, as the tests' numbers were pinned
    "model.mup_base_head_dim=16",
    "optim.lr_rule.width=32",  # the rule's LR (2e-3; Muon 2e-2) at this width, as the tests' numbers were pinned
    "optim.lr_rule.tokens_exponent=0",  # ... whatever their batch
    "model.context_length=32",
    "data.batch_size=4",
    "trainer.max_steps=6",
    "optim.warmup_steps=2",
    "trainer.val_check_interval=3",
    "data.val_windows=8",
    "trainer.log_every_n_steps=1",
    "trainer.enable_progress_bar=false",
]

# Two CPU processes over gloo, with a short collective timeout so a hang fails the test instead of stalling it.
DDP_TWO_CPU = [
    "trainer=cpu",
    "trainer.devices=2",
    "trainer.strategy={_target_: lightning.pytorch.strategies.DDPStrategy, "
    "timeout: {_target_: datetime.timedelta, seconds: 60}}",
]


def cli_env(cwd: Path, **extra: str) -> dict[str, str]:
    """The environment a command runs in as a user's would, with tests/ importable and `cwd` its project root."""
    path = os.pathsep.join([str(ROOT / "src"), str(ROOT), str(ROOT / "tests"), *sys.path])
    env = {**os.environ, "PYTHONPATH": path, "STEADYLM_ROOT": str(cwd), "OMP_NUM_THREADS": "1", **extra}
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def cli_steps(steps: int) -> list[str]:
    """CLI_TINY with its step count replaced."""
    return [o for o in CLI_TINY if not o.startswith("trainer.max_steps")] + [f"trainer.max_steps={steps}"]


def run_cli(
    *args: str, cwd: Path, timeout: int = 400, module: str | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python train.py ARGS` (or `python -m MODULE ARGS`) in `cwd`, as a user runs it; tests/ importable;
    `env` adds to (or overrides) the environment."""
    env = cli_env(cwd, **(env or {}))
    command = [sys.executable, "-m", module] if module else [sys.executable, str(ROOT / "train.py")]
    return subprocess.run([*command, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def raw_shard(path: Path, data, attrs: dict | None = None, **create) -> None:
    """A shard written by hand (not by prepare), to break one thing: format-1 bytes attributes, then `attrs`
    (a None value leaves that attribute out); `create` goes to `create_dataset` (dtype, compression, chunks)."""
    with h5py.File(path, "w") as f:
        if data is not None:
            f.create_dataset("tokens", data=data, **create)
        base = {
            "format_version": 1,
            "vocab_size": 257,
            "eos_id": 256,
            "tokenizer": "bytes",
            "n_tokens": 0 if data is None else len(data),
            "max_token_id": 0 if data is None or not len(data) else int(np.max(data)),
        }
        for k, v in {**base, **(attrs or {})}.items():
            if v is not None:
                f.attrs[k] = v


# --- in-process runs of the stability suite ---------------------------------------------------------------

FAST = [
    "trainer.max_steps=12",
    "trainer.limit_val_batches=0",
    "callbacks.checkpoint.every_n_train_steps=4",
    "trainer.log_every_n_steps=4",
    "model.d_model=32",
    "model.mup_base_width=32",  # with conftest's 2 heads: based at itself, as CLI_TINY
    "model.mup_base_head_dim=16",
    "optim.lr_rule.width=32",  # the rule's LR (2e-3; Muon 2e-2) at this width, as the tests' numbers were pinned
    "optim.lr_rule.tokens_exponent=0",  # ... whatever their batch
    "model.context_length=32",
    "data.batch_size=4",
    "callbacks.stability.recovery.every_n_steps=4",
]


def faults(*specs: dict) -> str:
    items = ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in s.items()) + "}" for s in specs)
    return f"+callbacks.faults={{_target_: steadylm.stability.faults.FaultInjector, faults: [{items}]}}"


class Snapshot(L.Callback):
    """Copies weights and AdamW state just before and just after optimizer step `step`; the LR each update used."""

    def __init__(self, step: int):
        self.step, self.before, self.after, self.lrs = step, None, None, []

    @staticmethod
    def _state(trainer, pl_module):
        opt = trainer.optimizers[0]
        return {
            "params": {n: p.detach().clone() for n, p in pl_module.named_parameters()},
            "adam": {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(pl_module.parameters())},
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.step:
            self.before = self._state(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])  # the LR the update just used
        if trainer.global_step == self.step + 1:
            self.after = self._state(trainer, pl_module)


class StateByStep(L.Callback):
    """Weights and the whole optimizer state (AdamW moments, Muon momentum, step counts) at the start and the end
    of every optimizer step: `start[s]`, `end[s]` (a tiny model's, for a rollback to be compared bitwise)."""

    def __init__(self):
        self.start, self.end = {}, {}

    @staticmethod
    def _state(trainer, pl_module) -> list:
        opt = trainer.optimizers[0]
        state = [{k: v.clone() for k, v in opt.state[p].items()} for p in pl_module.parameters()]
        return [p.detach().clone() for p in pl_module.parameters()] + [v for s in state for v in s.values()]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.start[trainer.global_step] = self._state(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.end[trainer.global_step - 1] = self._state(trainer, pl_module)


def same_tensors(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def stability_of(trainer):
    """The Trainer's one `Stability` callback."""
    from steadylm.stability import Stability

    return next(cb for cb in trainer.callbacks if isinstance(cb, Stability))


def fit(cfg, *extra_callbacks, precision_plugin=None):
    objs = build(cfg)
    if precision_plugin is not None:
        objs["trainer"].strategy.precision_plugin = precision_plugin
    objs["trainer"].callbacks.extend(extra_callbacks)
    objs["trainer"].fit(objs["module"], datamodule=objs["datamodule"])
    return objs


class ParamHash(L.Callback):
    """Writes this rank's parameter hash and skipped-step count at the end of fit (for the DDP test)."""

    def __init__(self, out: str):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        local = [p.to_local() if hasattr(p, "to_local") else p for p in pl_module.parameters()]  # FSDP2: its shard
        flat = torch.cat([p.detach().flatten() for p in local])
        digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()
        Path(self.out, f"rank{trainer.global_rank}.json").write_text(
            json.dumps({"hash": digest, "skipped": pl_module.skipped_steps, "step": trainer.global_step})
        )


def scalars(run_dir: Path) -> dict[str, list[float]]:
    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def crash_training_at(monkeypatch, step: int) -> None:
    """`training_step` raises "simulated crash" at optimizer step `step` (undo with `monkeypatch.undo()`)."""
    real_step = LMModule.training_step

    def fails(self, batch, batch_idx):
        if self.trainer.global_step == step:
            raise RuntimeError("simulated crash")
        return real_step(self, batch, batch_idx)

    monkeypatch.setattr(LMModule, "training_step", fails)


# --- the stats test's truth ---------------------------------------------------------------------------------

STEP = 7  # a stats step under FAST: (7 + 1) % 4 == 0, the second of steps 3, 7, 11


def norm(tensors) -> float:
    return float(torch.sqrt(sum(t.double().pow(2).sum() for t in tensors)))


class Truth(L.Callback):
    """Weights, pre-clip grads and the batch of step STEP, and the weights after its update."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == STEP:
            self.batch = [t.clone() for t in batch]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):  # after backward, before clipping
        if trainer.global_step == STEP:
            net = pl_module.net
            self.before = {n: p.detach().clone() for n, p in net.named_parameters()}
            self.grads = {n: p.grad.detach().clone() for n, p in net.named_parameters()}
            rms = {}
            hooks = [
                b.register_forward_hook(lambda m, a, out, i=i: rms.__setitem__(i, float(out.pow(2).mean().sqrt())))
                for i, b in enumerate(net.blocks)
            ]
            with torch.no_grad():
                lse = net(self.batch[0]).float().logsumexp(-1)
            for h in hooks:
                h.remove()
            self.rms = rms
            self.log_z = float(lse[self.batch[1] != -100].mean())  # over the targets the loss counts

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == STEP + 1:
            self.after = {n: p.detach().clone() for n, p in pl_module.net.named_parameters()}
