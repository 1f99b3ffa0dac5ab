"""Will the run fit? One simple estimate per process (`train.py` refuses, `doctor` prints it): fp32 weights, grads
and AdamW moments (sharded under FSDP), activations after Korthikanti et al. (2022) (~34·d values per token per
layer, fused attention), the logits and their gradient; against each GPU's memory, or the RAM CPU processes share.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from steadylm.devices import Devices
from steadylm.errors import ConfigError
from steadylm.model.config import GPTConfig
from steadylm.model.switches import require_understood

ADAMW_BYTES_PER_PARAM = 4 + 4 + 8  # fp32 weight, fp32 grad, two fp32 Adam moments
HEADROOM = 0.9  # allocator fragmentation, the CUDA context, the data loader, Python itself


@dataclass(frozen=True)
class MemoryPlan:
    parts: dict[str, int]  # bytes per process
    processes: int  # on this machine
    available: int | None  # bytes: per GPU, or RAM for all CPU processes together; None when unknown
    where: str

    @property
    def per_process(self) -> int:
        return sum(self.parts.values())

    @property
    def needed(self) -> int:
        """Against `available`: one process per GPU, or every CPU process in the same RAM."""
        return self.per_process if self.where.startswith("GPU") else self.per_process * self.processes

    @property
    def fits(self) -> bool:
        return self.available is None or self.needed <= HEADROOM * self.available

    def describe(self) -> str:
        parts = ", ".join(f"{k} {gib(v)}" for k, v in self.parts.items())
        have = f"{gib(self.available)} {self.where}" if self.available is not None else f"unknown {self.where}"
        scope = f" x {self.processes} processes" if self.needed != self.per_process else ""
        return f"~{gib(self.per_process)} per process{scope} ({parts}) vs {have}"


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def model_config(model_cfg: DictConfig | dict) -> GPTConfig:
    fields = OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    return GPTConfig(**fields)


def count_params(model_cfg: DictConfig | dict) -> int:
    """Parameters of the model the config builds, counted on the meta device (no memory allocated)."""
    from steadylm.model import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(model_config(model_cfg)).parameters())


def ram_available() -> int | None:
    """MemAvailable (what new processes can get without swapping), else total physical memory."""
    with contextlib.suppress(OSError, StopIteration):
        lines = Path("/proc/meminfo").read_text().splitlines()
        return next(int(x.split()[1]) * 1024 for x in lines if x.startswith("MemAvailable:"))
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def logits_bytes(cfg: DictConfig, tokens: int, elem: int) -> int:
    """The logits, their fp32 log-softmax and its gradient: every token's (plain), or a chunk's + the head's grad."""
    vocab, optim = int(cfg.model.vocab_size), cfg.get("optim") or {}
    if optim.get("loss", "chunked") == "plain":
        return tokens * vocab * (elem + 8)
    return min(tokens, int(optim.get("loss_chunk", 1024))) * vocab * (elem + 8) + vocab * int(cfg.model.d_model) * 4


def plan(cfg: DictConfig, precision: str, devices: Devices, n_params: int | None = None) -> MemoryPlan:
    m = model_config(cfg.model)
    require_understood(m, "memory")  # a switch this estimate does not count is refused, not under-counted
    n_params = count_params(cfg.model) if n_params is None else n_params
    shards = devices.world_size if "fsdp" in str(cfg.trainer.get("strategy", "")).lower() else 1
    elem = 4 if precision.startswith("32") else 8 if precision.startswith("64") else 2  # activation width
    tokens = int(cfg.data.batch_size) * m.context_length
    parts = {
        "weights+grads+adamw": n_params * ADAMW_BYTES_PER_PARAM // shards,
        "activations": tokens * m.n_layer * 34 * m.d_model * elem // 2,
        "logits": logits_bytes(cfg, tokens, elem),
    }
    if devices.on_cuda:
        gpu = torch.cuda.get_device_properties(0)
        return MemoryPlan(parts, devices.per_node, gpu.total_memory, f"GPU memory on {torch.cuda.get_device_name(0)}")
    return MemoryPlan(parts, devices.per_node, ram_available(), "RAM available")


def check_fits(cfg: DictConfig, precision: str, devices: Devices, n_params: int | None = None) -> MemoryPlan:
    """ConfigError, with the estimate, what is there and what to change, when the run cannot fit."""
    p = plan(cfg, precision, devices, n_params)
    if not p.fits:
        raise ConfigError(
            f"this run does not fit: {p.describe()}; lower data.batch_size (and raise trainer.accumulate_grad_batches "
            f"to keep the batch), lower model.context_length, use fewer trainer.devices on a CPU, or a smaller model"
        )
    return p
