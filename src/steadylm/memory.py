"""Will the run fit? One simple estimate per process (`train.py` refuses, `doctor` prints it): fp32 weights, grads
and AdamW moments (sharded under FSDP), activations after Korthikanti et al. (2022) (~34·d bytes per token per
layer at 2 bytes a value, fused attention; less under `model.activation_checkpointing`), the logits and their gradient; against each GPU's memory, or the RAM CPU processes share."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from steadylm.devices import Devices
from steadylm.model.config import GPTConfig
from steadylm.model.switches import require_understood

ADAMW_BYTES_PER_PARAM = 4 + 4 + 8  # fp32 weight, fp32 grad, two fp32 Adam moments
# d_model-wide values a token keeps for backward per layer, by `model.activation_checkpointing`: all 17 of
# Korthikanti's 34·s·b·h bytes at 2 a value; selective keeps the block's input and what its matmuls and attention
# produce (q, k, v 3, attention 1, its projection 1, the MLP's 4 + 1); blocks keeps the block's input alone.
KEPT_PER_LAYER = {"none": 17, "selective": 11, "blocks": 1}
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
        gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
        parts = ", ".join(f"{k} {gib(v)}" for k, v in self.parts.items())
        have = f"{'unknown' if self.available is None else gib(self.available)} {self.where}"
        scope = f" x {self.processes} processes" if self.needed != self.per_process else ""
        return f"~{gib(self.per_process)} per process{scope} ({parts}) vs {have}"


def count_params(model_cfg: DictConfig) -> int:
    """Parameters of the model the config builds, counted on the meta device (no memory allocated)."""
    from steadylm.model import GPT

    with torch.device("meta"):
        return sum(p.numel() for p in GPT(GPTConfig(**OmegaConf.to_container(model_cfg, resolve=True))).parameters())


def ram_available() -> int | None:
    """MemAvailable (what new processes can get without swapping), else total physical memory."""
    with contextlib.suppress(OSError, StopIteration):
        lines = Path("/proc/meminfo").read_text().splitlines()
        return next(int(x.split()[1]) * 1024 for x in lines if x.startswith("MemAvailable:"))
    with contextlib.suppress(ValueError, OSError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def sharded(cfg: DictConfig) -> bool:
    return "fsdp" in str(cfg.trainer.get("strategy", "")).lower()


def plan(
    cfg: DictConfig,
    precision: str,
    devices: Devices,
    batch_size: int,
    n_params: int | None = None,
    recompute: str | None = None,
    fsdp: bool | None = None,
) -> MemoryPlan:
    """The estimate for `batch_size` sequences a micro-batch (the DataModule's: `DataSource.batch_size`); `recompute`
    and `fsdp` stand in for the config's activation checkpointing and strategy (`advice` asks what they would save)."""
    model = OmegaConf.to_container(cfg.model, resolve=True)
    m = GPTConfig(**{**model, **({"activation_checkpointing": recompute} if recompute else {})})
    require_understood(m, "memory")  # a switch this estimate does not count is refused, not under-counted
    n_params = count_params(cfg.model) if n_params is None else n_params
    shards = devices.world_size if (sharded(cfg) if fsdp is None else fsdp) else 1
    elem = 4 if precision.startswith("32") else 8 if precision.startswith("64") else 2  # activation width
    tokens, vocab, optim = int(batch_size) * m.context_length, int(m.vocab_size), cfg.get("optim") or {}
    kept = KEPT_PER_LAYER[m.activation_checkpointing]
    # the logits, their fp32 log-softmax and its gradient: every token's (plain), or a chunk's + the head's grad
    chunked = optim.get("loss", "chunked") != "plain"
    logit_tokens = min(tokens, int(optim.get("loss_chunk", 1024))) if chunked else tokens
    parts = {
        "weights+grads+adamw": n_params * ADAMW_BYTES_PER_PARAM // shards,
        # what every layer keeps, and while one block is recomputed in backward, its own activations again
        "activations": tokens * m.d_model * elem * (m.n_layer * kept + (17 if kept < 17 else 0)),
        "logits": logit_tokens * vocab * (elem + (16 if m.logit_softcap else 8)) + vocab * int(m.d_model) * 4 * chunked,
    }
    if devices.on_cuda:
        gpu = torch.cuda.get_device_properties(0)
        return MemoryPlan(parts, devices.per_node, gpu.total_memory, f"GPU memory on {torch.cuda.get_device_name(0)}")
    return MemoryPlan(parts, devices.per_node, ram_available(), "RAM available")


def advice(cfg: DictConfig, precision: str, devices: Devices, batch_size: int, n_params: int | None = None) -> str:
    """What to set so that the run fits by this estimate: of activation checkpointing (none, selective, blocks) and,
    on several GPUs, FSDP2, the choice that fits the largest micro-batch (up to the configured one), the least
    recompute and no sharding on a tie; or that none does."""
    n_params = count_params(cfg.model) if n_params is None else n_params
    modes = list(KEPT_PER_LAYER)  # none, selective, blocks: the least recompute first
    now = str(cfg.model.get("activation_checkpointing", "none"))
    shard = [False, True] if not sharded(cfg) and devices.on_cuda and devices.world_size > 1 else [sharded(cfg)]
    best = None  # (micro-batch, -recompute, -sharded)
    for fsdp in shard:
        for mode in modes[modes.index(now) :]:
            fits = (
                b for b in range(int(batch_size), 0, -1) if plan(cfg, precision, devices, b, n_params, mode, fsdp).fits
            )
            if (b := next(fits, None)) is not None:
                best = max(best or (b, -modes.index(mode), -fsdp), (b, -modes.index(mode), -fsdp))
    if best is None:
        more = "more GPUs under trainer=fsdp" if devices.on_cuda else "fewer trainer.devices (they share the RAM)"
        return f"not even data.batch_size=1 with model.activation_checkpointing=blocks fits: {more}, or a smaller model"
    b, mode, fsdp = best[0], modes[-best[1]], bool(-best[2])
    keys = [f"data.batch_size={b}"] if b < int(batch_size) else []
    keys += [f"model.activation_checkpointing={mode}"] if mode != now else []
    keys += ["trainer=fsdp"] if fsdp and not sharded(cfg) else []
    keep = " (data.global_batch_tokens keeps the tokens per step)" if b < int(batch_size) else ""
    return f"it fits with {' '.join(keys)}{keep}" if keys else "it fits as it is"
