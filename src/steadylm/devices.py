"""What a run trains on, resolved once by Lightning's rules, since the global batch, memory estimate, preflight and
`doctor` need the answer before the Trainer exists: `trainer.accelerator` (`auto`: mps, else cuda, else cpu),
`trainer.devices` (`auto`: every visible CUDA GPU, one interactively) and the precision (`auto`: bf16 if fast)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from steadylm.compat import cpu_has_bf16
from steadylm.errors import ConfigError

ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps")
ALLOWED_DEVICES = "auto, -1, a whole number > 0, or a list of distinct device ids"
AUTO_PRECISION_ENV = "STEADYLM_AUTO_PRECISION"
LEGACY = {"16": "16-mixed", "bf16": "bf16-mixed", "32": "32-true", "64": "64-true"}  # -> "<dtype>-<mode>"


@dataclass(frozen=True)
class Devices:
    accelerator: str  # what the Trainer runs on: "cpu", "cuda" or "mps"
    per_node: int  # processes on each machine, one per device
    num_nodes: int

    @property
    def world_size(self) -> int:
        return self.per_node * self.num_nodes

    @property
    def on_cuda(self) -> bool:
        return self.accelerator == "cuda"


def parse_devices(value: Any) -> str | int | list[int] | None:
    """`trainer.devices` as "auto", -1, a count > 0, or a list of distinct GPU ids; None when it is none of those."""
    if isinstance(value, str) and "," in value:  # "0,1": GPU ids
        parts = [p.strip() for p in value.split(",") if p.strip()]
        value = [int(p) for p in parts] if all(p.isdigit() for p in parts) else None
    elif isinstance(value, str) and (value := value.strip()) != "auto":
        value = int(value) if value.lstrip("-").isdigit() else None
    if OmegaConf.is_list(value) or isinstance(value, (list, tuple)):
        ids = list(value)
        return ids if ids and all(type(i) is int and i >= 0 for i in ids) and len(set(ids)) == len(ids) else None
    return value if value == "auto" or (type(value) is int and (value > 0 or value == -1)) else None


def resolve(trainer: DictConfig, cuda_devices: int, mps: bool, interactive: bool = False) -> Devices:
    """The Devices a Trainer built from `trainer` would use, on a machine with `cuda_devices` visible CUDA GPUs."""
    raw, nodes = trainer.get("devices", "auto"), int(trainer.get("num_nodes", 1) or 1)
    asked = str(trainer.get("accelerator", "auto"))
    auto = "mps" if mps else "cuda" if cuda_devices else "cpu"
    accelerator = {"auto": auto, "gpu": "mps" if mps else "cuda"}.get(asked, asked)
    if accelerator not in ("cpu", "cuda", "mps"):
        raise ConfigError(f"trainer.accelerator={asked!r} is not allowed; it must be one of {', '.join(ACCELERATORS)}")
    if (accelerator == "cuda" and not cuda_devices) or (accelerator == "mps" and not mps):
        what = "CUDA GPU" if accelerator == "cuda" else "Apple MPS device"
        raise ConfigError(
            f"trainer.accelerator={asked} but no {what} is visible on this machine; "
            "use trainer=cpu (or trainer.accelerator=auto)"
        )
    if (devices := parse_devices(raw)) is None:
        raise ConfigError(f"trainer.devices={raw!r} is not allowed; it must be {ALLOWED_DEVICES}")
    if accelerator == "cpu" and (isinstance(devices, list) or devices == -1):
        raise ConfigError(
            f"trainer.devices={raw} picks GPUs (-1: every GPU; a list: their ids), but this run is on the CPU, "
            "which takes a number of processes; "
            f"set trainer.devices={len(devices) if isinstance(devices, list) else 1} (or run on a GPU)"
        )
    visible = cuda_devices if accelerator == "cuda" else 1  # Lightning drives one MPS device; `auto`: one CPU process
    if devices == "auto":
        devices = 1 if interactive or accelerator != "cuda" else visible
    ids = list(range(visible)) if devices == -1 else devices if isinstance(devices, list) else list(range(devices))
    if accelerator != "cpu" and not set(ids) <= set(range(visible)):
        raise ConfigError(
            f"trainer.devices={raw} asks for {len(ids)} GPUs but {visible} {'is' if visible == 1 else 'are'} "
            f"visible on this machine; set trainer.devices={visible} or fewer"
        )
    return Devices(accelerator, len(ids), nodes)


def devices_of(cfg: DictConfig) -> Devices:
    """The Devices this run will use on this machine (ConfigError where Lightning would refuse the settings)."""
    mps = torch.backends.mps.is_available() and os.environ.get("DISABLE_MPS", "0") != "1"
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return resolve(cfg.trainer, cuda, mps, interactive=hasattr(sys, "ps1") or bool(sys.flags.interactive))


def resolve_precision(precision: Any, accelerator: str) -> str:
    """`auto`: bf16-mixed where the resolved `accelerator` has bf16 units (a CPU without them emulates it ~10x
    slower), else fp32; `STEADYLM_AUTO_PRECISION` overrides it, so tests can run as the other kind of machine."""
    if (precision := str(precision)) != "auto":
        return LEGACY.get(precision, precision)
    if os.environ.get(AUTO_PRECISION_ENV):
        return os.environ[AUTO_PRECISION_ENV]
    supported = torch.cuda.is_bf16_supported() if accelerator == "cuda" else cpu_has_bf16()
    return "bf16-mixed" if supported else "32-true"
