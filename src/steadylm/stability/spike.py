"""`SpikeDetector`: a loss spike that persists rolls back; a one-off is logged; a grad-norm spike alone is counted.

The statistic is robust, so healthy runs raise nothing at any batch size or depth: each value is taken in
log space (a loss spike is a ratio, whatever the loss level), compared with the median of the last
`window` accepted values, in units of their robust scale 1.4826·MAD (the std for normal noise; one wild
value cannot inflate it as it inflates a std). The scale never goes below a noise floor
`noise_floor / sqrt(sequences per step)`: a small batch's loss is noisier than a large one's, and a
quiet stretch must not make the bar razor-thin. A loss is a spike above median + `sigma`·scale; a grad
norm above median + max(`sigma`·scale, log `grad_ratio`): clipping bounds its update, so unless the loss
confirms it (then it is part of the loss spike's event) it is only counted (`stability/grad_spikes`).
Armed after `warmup` accepted values. Spikes and
non-finite values (the guard's business) never enter the window. The window is in `state_dict`.

A loss spike opens an *episode* at its step (the onset). If the loss comes back under the bar within
`patience` steps it was a one-off: one `loss_spike` event with action `log`, the cause (the batch: the
weights were fine before and after it) and the step's samples ranked in `stability/suspects.jsonl`. If
it stays above for `patience` steps in a row the weights are broken: `action: rollback` (the default)
asks `Recovery` to restore the last good snapshot (skipping the data since), then re-runs the onset
batch on those good weights to name the cause: still a high loss -> the data; a normal loss -> the
update (LR, optimizer state). `action: skip` also skips each spiking step at once (read at the step
itself, one host sync a step); `action: log` only reports.
"""

from __future__ import annotations

import math
from collections import deque

import lightning as L
import numpy as np
from lightning.pytorch.strategies import FSDPStrategy

from steadylm.errors import ConfigError
from steadylm.logging_steps import will_log, write_metrics
from steadylm.stability.events import emit
from steadylm.stability.probe import ProbeUser
from steadylm.stability.suspects import batch_window_ids, rank_suspects, sample_losses, write_suspects

ACTIONS = ("log", "skip", "rollback")
SIGNALS = {"loss": "loss_spike", "grad_norm": "grad_spike"}
MAD_TO_STD = 1.4826
TOP_SUSPECTS = 3


class RobustWindow:
    """The last `size` values (log space); their median and robust scale."""

    def __init__(self, size: int, values=()) -> None:
        self.values: deque[float] = deque(values, maxlen=size)

    def add(self, v: float) -> None:
        self.values.append(v)

    def __len__(self) -> int:
        return len(self.values)

    def center_scale(self) -> tuple[float, float]:
        a = np.fromiter(self.values, dtype=float, count=len(self.values))
        med = float(np.median(a))
        return med, MAD_TO_STD * float(np.median(np.abs(a - med)))


class SpikeDetector(ProbeUser, L.Callback):
    def __init__(
        self,
        sigma: float = 6.0,
        window: int = 128,
        warmup: int = 32,
        action: str = "rollback",
        signals: tuple[str, ...] = ("loss", "grad_norm"),
        patience: int = 4,
        noise_floor: float = 0.1,
        grad_ratio: float = 4.0,
    ) -> None:
        if action not in ACTIONS:
            raise ConfigError(f"callbacks.spike.action={action!r} is not one of {', '.join(ACTIONS)}")
        unknown = set(signals) - set(SIGNALS)
        if unknown:
            raise ConfigError(f"callbacks.spike.signals has unknown {sorted(unknown)}; use any of {sorted(SIGNALS)}")
        if not 1 <= warmup <= window:
            raise ConfigError(f"callbacks.spike.warmup={warmup} must be between 1 and callbacks.spike.window={window}")
        if patience < 1:
            raise ConfigError(f"callbacks.spike.patience={patience} must be >= 1")
        self.sigma, self.window, self.warmup, self.action = float(sigma), int(window), int(warmup), action
        self.signals = tuple(signals)
        self.patience, self.noise_floor, self.grad_ratio = int(patience), float(noise_floor), float(grad_ratio)
        self.defer = action != "skip"  # skip acts before this step's update: read each value at once
        self.stats = {s: RobustWindow(self.window) for s in self.signals}
        self.episode: dict | None = None  # the loss spike under way: onset step, values, the onset batch
        self.sequences = 1  # per optimizer step, all ranks (sets the noise floor)
        self.grad_spikes = 0  # grad-norm spikes the loss did not confirm (`stability/grad_spikes`)
        self.last_grad_spike: dict | None = None

    # -- the statistic ----------------------------------------------------------------------------------------
    def bar(self, signal: str) -> float | None:
        """The value above which `signal` is a spike now; None while not armed."""
        stats = self.stats[signal]
        if len(stats) < self.warmup:
            return None
        med, scale = stats.center_scale()
        if signal == "loss":
            return math.exp(med + self.sigma * max(scale, self.noise_floor / math.sqrt(self.sequences)))
        return math.exp(med + max(self.sigma * scale, math.log(self.grad_ratio)))

    def window_state(self) -> dict:
        return {s: list(st.values) for s, st in self.stats.items()}

    def load_window_state(self, state: dict) -> None:
        self.stats = {s: RobustWindow(self.window, state.get(s, ())) for s in self.signals}

    # -- each measurement -------------------------------------------------------------------------------------
    def observe(self, trainer, pl_module, optimizer, m) -> None:
        if m.nonfinite:
            return
        if m.batches:
            self.sequences = max(1, sum(int(b[0].shape[0]) for b in m.batches) * trainer.world_size)
        loss_bar = self.bar("loss") if "loss" in self.stats else None
        high = loss_bar is not None and m.loss > loss_bar
        if self.episode is not None:
            if high:
                self._continue(trainer, pl_module, optimizer, m)
                return
            self._recovered(trainer, pl_module, m)
        if high:
            self._open(trainer, pl_module, optimizer, m, loss_bar)
            return
        if "grad_norm" in self.stats:
            grad_bar = self.bar("grad_norm")
            if grad_bar is not None and m.grad_norm > grad_bar:
                # Clipping bounds the update and the loss did not confirm it: counted in the metrics, no event
                # (small-batch runs have them while perfectly healthy).
                self.grad_spikes += 1
                self.last_grad_spike = {"step": m.step, "value": m.grad_norm, "threshold": grad_bar}
            elif m.grad_norm > 0:
                self.stats["grad_norm"].add(math.log(m.grad_norm))
        if "loss" in self.stats and m.loss > 0:
            self.stats["loss"].add(math.log(m.loss))

    def _open(self, trainer, pl_module, optimizer, m, bar: float) -> None:
        grad_bar = self.bar("grad_norm") if "grad_norm" in self.stats else None
        self.episode = {
            "onset": m.step,
            "bar": bar,
            "values": [m.loss],
            "grad_norm": m.grad_norm,
            "grad_bar": grad_bar,
            "batches": m.batches,
            "batch_idx": m.batch_idx,
        }
        self.suite.suspect_steps.add(m.step)
        if self.action == "skip":
            self.suite.probe.skip(trainer, pl_module, m)
        if self.patience <= 1:
            self._persisted(trainer, pl_module, optimizer, m)

    def _continue(self, trainer, pl_module, optimizer, m) -> None:
        ep = self.episode
        ep["values"].append(m.loss)
        self.suite.suspect_steps.add(m.step)
        if ep.get("reported"):
            return  # `action: log`: a persisting spike is reported once, and watched until the loss is back
        if self.action == "skip":
            self.suite.probe.skip(trainer, pl_module, m)
        if len(ep["values"]) >= self.patience:
            self._persisted(trainer, pl_module, optimizer, m)

    def _detail(self, trainer, ep: dict) -> dict:
        return {
            "value": ep["values"][0],
            "threshold": ep["bar"],
            "sigma": self.sigma,
            "grad_norm": ep["grad_norm"],
            "grad_spike": ep["grad_bar"] is not None and ep["grad_norm"] > ep["grad_bar"],
            "steps_above": len(ep["values"]),
            "peak": max(ep["values"]),
            "batch": [batch_window_ids(trainer, i) for i in ep["batch_idx"]],
        }

    def _suspects(self, trainer, pl_module, ep: dict, weights, step_of_weights: int | None) -> dict:
        """Rank the onset batch's samples by their loss on the given (pre-spike) weights; write suspects.jsonl."""
        if not ep["batches"]:
            return {}
        if weights is not None and isinstance(trainer.strategy, FSDPStrategy):
            weights, step_of_weights = None, None  # a snapshot holds this rank's shards only: use the live weights
        losses = sample_losses(pl_module, ep["batches"], weights)
        rows = rank_suspects(trainer, ep["onset"], ep["batch_idx"], losses)
        for row in rows:
            row["weights_step"] = step_of_weights
        write_suspects(trainer, rows)
        mean = sum(v for _, _, v in losses) / max(len(losses), 1)
        top = [{k: r[k] for k in ("window", "shard", "start", "end", "loss")} for r in rows[:TOP_SUSPECTS]]
        return {"batch_loss_on_good_weights": mean, "suspects": top}

    def _recovered(self, trainer, pl_module, m) -> None:
        """The loss came back under the bar at `m.step`: a one-off, logged with its cause and suspects."""
        ep, self.episode = self.episode, None
        if ep.get("reported"):
            return
        detail = self._detail(trainer, ep)
        snap = self.suite.recovery.newest_good(before=ep["onset"]) if self.suite.recovery else None
        evidence = self._suspects(trainer, pl_module, ep, snap, snap.step if snap else None)
        if len(ep["values"]) == 1:
            cause = "data"
            why = (
                f"one step above the bar, back under it at step {m.step} with the same weights: "
                "the batch was unusual, not the model"
            )
        else:
            cause = "inconclusive"
            why = f"{len(ep['values'])} steps above the bar, back under it at step {m.step}: a bad batch or a transient"
        emit(
            trainer,
            ep["onset"],
            "loss_spike",
            "skip" if self.action == "skip" else "log",
            {**detail, "cause": cause, "evidence": why, "recovered_at": m.step, **evidence},
        )

    def _persisted(self, trainer, pl_module, optimizer, m) -> None:
        ep = self.episode
        detail = self._detail(trainer, ep)
        if self.action == "log" or optimizer is None:
            ep["reported"] = True
            why = f"above the bar for {len(ep['values'])} steps; not rolled back (callbacks.spike.action=log)"
            self._log_inconclusive(trainer, ep, why, persisting=True)
            return
        self.episode = None
        recovery = self.suite.recovery
        restored = recovery.rollback(trainer, pl_module, optimizer, ep["onset"])
        if restored is None:
            emit(trainer, ep["onset"], "loss_spike", "stop", {**detail, "persisting": True})
            reason = f"loss spike at step {ep['onset']} persisted for {len(ep['values'])} steps and " + (
                "the rollback budget is spent"
                if recovery.rollbacks >= recovery.max_rollbacks
                else "there is no good snapshot or checkpoint to roll back to"
            )
            recovery.stop(trainer, pl_module, m.step, "loss_spike", reason, {"rollbacks": recovery.rollbacks})
            return
        # The live weights are now the good ones from before the onset: re-run the onset batch on them.
        evidence = self._suspects(trainer, pl_module, ep, None, restored["to_step"])
        good = evidence.get("batch_loss_on_good_weights")
        if good is None:
            cause, why = "inconclusive", "the onset batch was not kept"
        elif good > ep["bar"]:
            cause, why = (
                "data",
                (
                    f"the onset batch's loss on the good step-{restored['to_step']} weights is {good:.3f}, "
                    f"above the bar {ep['bar']:.3f}: the batch itself is bad"
                ),
            )
        else:
            cause, why = (
                "update",
                (
                    f"the onset batch's loss on the good step-{restored['to_step']} weights is {good:.3f}, "
                    f"under the bar {ep['bar']:.3f}, yet the loss stayed above it for {len(ep['values'])} "
                    "steps: an update broke the weights (LR, optimizer state)"
                ),
            )
        emit(trainer, ep["onset"], "loss_spike", "rollback", {**detail, "cause": cause, "evidence": why, **evidence})
        emit(trainer, m.step, "rollback", "rollback", {**restored, "cause": "loss_spike", "onset": ep["onset"]})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self.grad_spikes and will_log(trainer):
            write_metrics(trainer, {"stability/grad_spikes": float(self.grad_spikes)})

    def on_suite_end(self, trainer, pl_module) -> None:
        if self.episode is not None and not self.episode.get("reported"):  # ended inside an episode: report it
            ep, self.episode = self.episode, None
            self._log_inconclusive(trainer, ep, "training ended before the loss came back")

    def _log_inconclusive(self, trainer, ep: dict, evidence: str, **extra) -> None:
        detail = {**self._detail(trainer, ep), "cause": "inconclusive", **extra, "evidence": evidence}
        emit(trainer, ep["onset"], "loss_spike", "log", detail)

    def state_dict(self) -> dict:
        return {"values": self.window_state(), "sequences": self.sequences, "grad_spikes": self.grad_spikes}

    def load_state_dict(self, state: dict) -> None:
        self.load_window_state(state.get("values", {}))
        self.sequences = int(state.get("sequences", 1))
        self.grad_spikes = int(state.get("grad_spikes", 0))
