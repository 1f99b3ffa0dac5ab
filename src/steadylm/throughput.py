"""Tokens/s and MFU, logged every `log_every_n_steps` from the wall-clock time between logging steps: a step only
adds its batch's token count (a shape, never a device value, so no host sync) and compares its step number.
"""

from __future__ import annotations

import time

import lightning as L
import torch

from steadylm.logging_steps import write_metrics

# Dense bf16 peak FLOP/s per device. Lightning's table has no H200; H100 and H200 SXM share a peak.
PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "A10G": 125e12, "L4": 121e12, "4090": 165.2e12}


def peak_flops(device_name: str) -> float | None:
    return next((v for k, v in PEAK_FLOPS.items() if k in device_name), None)


class Throughput(L.Callback):
    """`peak_flops` overrides the table (FLOP/s per device), e.g. for a GPU it lacks; MFU is logged when known."""

    def __init__(self, peak_flops: float | None = None) -> None:
        self.peak_flops, self._tokens, self._t0, self._last_step = peak_flops, 0, None, -1
        self.tokens_per_sec: float | None = None  # the last measurement (the progress line shows it)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._tokens += batch[0].numel()
        step = trainer.global_step  # optimizer steps done: unchanged across accumulated micro-batches
        if step % max(1, trainer.log_every_n_steps) or step == self._last_step:
            return  # not a logging step (`is_logging_step(step - 1, ...)`, inline), or inside accumulation
        self._last_step = step
        now = time.perf_counter()
        if self._t0 is not None and now > self._t0:
            self.tokens_per_sec = tps = self._tokens * trainer.world_size / (now - self._t0)
            metrics = {"perf/tokens_per_sec": tps}
            name = torch.cuda.get_device_name(pl_module.device) if pl_module.device.type == "cuda" else ""
            if peak := self.peak_flops or peak_flops(name):
                metrics["perf/mfu"] = tps / trainer.world_size * pl_module.net.flops_per_token() / peak
            write_metrics(trainer, metrics)
        self._t0, self._tokens = now, 0
