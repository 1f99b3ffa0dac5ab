"""`SpikeDetector`: loss or grad norm above mean + sigma·std of a rolling window -> log, skip or roll back.

Defaults follow OLMo-core (6 sigma over 128 steps, armed after 64). It reads the probe's all-reduced
host values, so every rank computes the same window and takes the same action with no extra
collective. With `action: log` it reads them one step late (the probe's deferred mode, no host sync);
`skip` and `rollback` must act before the step's update, so they read each step's value at once.
Spikes and non-finite values (the guard's business) never enter the window, so one bad step cannot
raise the bar for the next. The window is part of `state_dict`: it survives resume.
"""

from __future__ import annotations

import math
from collections import deque

import lightning as L

from steadylm.errors import ConfigError
from steadylm.stability.events import emit
from steadylm.stability.forensics import window_indices
from steadylm.stability.probe import ProbeUser, probe_for
from steadylm.stability.rollback import rollback

ACTIONS = ("log", "skip", "rollback")
SIGNALS = {"loss": "loss_spike", "grad_norm": "grad_spike"}


class RollingStats:
    """Mean and std of the last `size` values in O(1) per step."""

    def __init__(self, size: int, values=()) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self.total = self.total_sq = 0.0
        for v in values:
            self.add(v)

    def add(self, v: float) -> None:
        if len(self.values) == self.values.maxlen:
            old = self.values[0]
            self.total -= old
            self.total_sq -= old * old
        self.values.append(v)
        self.total += v
        self.total_sq += v * v

    def __len__(self) -> int:
        return len(self.values)

    def threshold(self, sigma: float) -> float:
        n = len(self.values)
        mean = self.total / n
        return mean + sigma * math.sqrt(max(self.total_sq / n - mean * mean, 0.0))


class SpikeDetector(ProbeUser, L.Callback):
    def __init__(
        self, sigma: float = 6.0, window: int = 128, warmup: int = 64, action: str = "log",
        signals: tuple[str, ...] = ("loss", "grad_norm"), max_rollbacks: int = 3,
    ) -> None:
        if action not in ACTIONS:
            raise ConfigError(f"callbacks.spike.action={action!r} is not one of {', '.join(ACTIONS)}")
        unknown = set(signals) - set(SIGNALS)
        if unknown:
            raise ConfigError(f"callbacks.spike.signals has unknown {sorted(unknown)}; use any of {sorted(SIGNALS)}")
        if not 1 <= warmup <= window:
            raise ConfigError(f"callbacks.spike.warmup={warmup} must be between 1 and callbacks.spike.window={window}")
        self.sigma, self.window, self.warmup, self.action = float(sigma), int(window), int(warmup), action
        self.signals = tuple(signals)
        self.defer = action == "log"  # skip and rollback must act before this step's update: read it at once
        self.max_rollbacks = int(max_rollbacks)
        self.rollbacks = 0
        self.stats = {s: RollingStats(self.window) for s in self.signals}

    def observe(self, trainer, pl_module, optimizer, m):
        if m.nonfinite:
            return
        spikes = {}
        for signal in self.signals:
            value, stats = getattr(m, signal), self.stats[signal]
            if len(stats) >= self.warmup and value > (bar := stats.threshold(self.sigma)):
                spikes[signal] = {"value": value, "threshold": bar}
            else:
                stats.add(value)
        if spikes:
            self._act(trainer, pl_module, optimizer, m, spikes)

    def _act(self, trainer, pl_module, optimizer, m, spikes: dict) -> None:
        batch = [window_indices(trainer, i) for i in m.batch_idx]
        restored = None
        if self.action == "rollback" and self.rollbacks < self.max_rollbacks:
            restored = rollback(trainer, pl_module, optimizer, m.step)
            self.rollbacks += restored is not None
        if self.action != "log" and not restored:
            probe_for(trainer).skip(trainer, pl_module, m)
        action = "rollback" if restored else ("skip" if self.action != "log" else "log")
        for signal, detail in spikes.items():
            emit(trainer, m.step, SIGNALS[signal], action, {**detail, "sigma": self.sigma, "batch": batch})
        if restored:
            emit(trainer, m.step, "rollback", "rollback", {**restored, "cause": "spike"})

    def state_dict(self) -> dict:
        return {"values": {s: list(st.values) for s, st in self.stats.items()}, "rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        self.stats = {s: RollingStats(self.window, state["values"].get(s, ())) for s in self.signals}
        self.rollbacks = int(state.get("rollbacks", 0))
