"""What a run reports at each logging step. `Throughput`: tokens/s and MFU from the wall-clock time between logging
steps (a step only adds its batch's token count, a shape, never a device value: no host sync). `ProgressLines`, in
place of Lightning's bar: plain lines, not a redrawn bar, so the console, `train.log` and a SLURM log read the same
(`step 60/300 | loss 3.1990 | 40.8k tok/s | stability: ok`, any live forecast; `val  60/300 | loss 3.1872 | bpb 1.931`)."""

from __future__ import annotations

import time

import lightning as L
import torch
from lightning.pytorch.callbacks import ProgressBar

from steadylm.logging_steps import write_metrics
from steadylm.stability.events import events_path, read_events

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


def live_forecast(events: list[dict]) -> dict | None:
    """The newest `forecast` event's detail, unless an alarm on its signal (or a backoff) came after it."""
    for e in reversed(events):
        if e["kind"] == "forecast":
            return e["detail"]
        if e["kind"] in ("lr_backoff", "rollback", "qk_clip") or e.get("detail", {}).get("signal") is not None:
            return None
    return None


class ProgressLines(ProgressBar):
    def __init__(self) -> None:
        super().__init__()
        self.is_enabled, self._last_step = True, -1  # is_enabled: read by LightningModule.print
        self._events: tuple[int, str] = (-1, "ok")  # (events.jsonl size read, the status it gave)
        self._live: dict | None = None  # the newest forecast's detail while its horizon lasts and nothing came yet

    def disable(self) -> None:
        self.is_enabled = False

    def enable(self) -> None:
        self.is_enabled = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step  # a line on the steps whose loss is logged (`is_logging_step(step - 1)`)
        if not self.is_enabled or step == self._last_step or step % max(1, trainer.log_every_n_steps):
            return
        self._last_step = step
        parts = [f"step {step}/{trainer.max_steps}"]
        if (loss := trainer.callback_metrics.get("train/loss")) is not None:
            parts.append(f"loss {float(loss):.4f}")
        if rate := next((c.tokens_per_sec for c in trainer.callbacks if isinstance(c, Throughput)), None):
            parts.append(f"{rate / 1e3:.1f}k tok/s")
        parts.append(f"stability: {self._stability(trainer)}")
        if (d := self._live) is not None and step <= d.get("by_step", d["expected_step"]):
            parts.append(
                f"forecast: {d['signal']} {d['value']:.3g} -> {d['threshold']:g} by step ~{d['expected_step']}"
            )
        print(" | ".join(parts), flush=True)

    def on_validation_end(self, trainer, pl_module) -> None:
        if not self.is_enabled or trainer.sanity_checking:
            return
        m = trainer.callback_metrics
        parts = [f"val  {trainer.global_step}/{trainer.max_steps}"]
        parts += [f"{name} {float(m[key]):.4f}" for name, key in (("loss", "val/loss"), ("bpb", "val/bpb")) if key in m]
        print(" | ".join(parts), flush=True)

    def _stability(self, trainer) -> str:
        """`ok`, or how many events `stability/events.jsonl` holds and the last one (re-read when it grew)."""
        path = events_path(trainer)
        size = path.stat().st_size if path.exists() else 0
        if size != self._events[0]:
            events = read_events(path.parent.parent)
            self._live = live_forecast(events)
            e = events[-1] if events else {}
            status = f"{len(events)} event(s), last {e['kind']} -> {e['action']} at step {e['step']}" if e else "ok"
            self._events = (size, status)
        return self._events[1]
