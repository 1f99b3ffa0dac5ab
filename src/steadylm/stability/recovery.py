"""`Recovery`: snapshots of the last good state, rollback to them with escalation, and a bounded budget.

Every `every_n_steps` steps the state (weights, buffers, optimizer, RNGs, the spike window) is copied aside, never
into training memory (`snapshot_store`); it is *known-good* once its step's loss is finite and no check found it
suspect, and the last `keep` are kept. A rollback restores, bitwise, the newest known-good one from before the
trouble (a checkpoint when there is none) and skips the batches since; a repeat at the same place goes further back
and skips more, a third lowers the LR, past `max_rollbacks` the run stops. Every rank decides alike from the same
reduced values. At the end a final loss far above the best since the last restore has diverged (`final_verdict`);
one that never got back to the best before that restore was cut short (`unrecovered`), not diverged.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import statistics
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from lightning.fabric.utilities.apply_func import apply_to_collection

from steadylm.checkpointing import rng_state, set_rng_state
from steadylm.distributed import from_local, local, reshard, sharding
from steadylm.errors import ConfigError
from steadylm.stability import rollback as disk
from steadylm.stability.events import stability_dir
from steadylm.stability.measure import Measurement
from steadylm.stability.snapshot_store import STORES, HostBuffers, SnapshotFile
from steadylm.stability.verdict import Verdict

log = logging.getLogger(__name__)

SLOW_WRITE = 0.02  # a snapshot may cost this share of the steps between snapshots (benchmarks/snapshot_bench.py)
SLOW_WRITE_MIN_S = 0.25  # ... and a wait shorter than this is a busy machine's hiccup, not a slow disk


@dataclass
class Snapshot:
    step: int  # optimizer steps done when taken (the global step about to run)
    applied: int  # of those, steps whose update is in the weights
    store: HostBuffers | SnapshotFile  # the parameters, then buffers, then each optimizer's state tensors
    n_weights: int  # how many of the store's tensors are parameters and buffers
    optim: list[dict]  # each optimizer's state_dict, its tensors replaced by their index in the store
    rng: dict
    detectors: dict

    def weights(self) -> list[torch.Tensor]:
        """Host copies of the parameters then buffers (not to be written: in memory they are the store's own)."""
        return self.store.read(0, self.n_weights, copy=False)


_STATE = ("rollbacks", "strikes", "last_onset", "skip_until", "restored")  # with `recent` and `best`, checkpointed


@dataclass(frozen=True)
class _Slot:
    index: int
    sharding: tuple | None = None  # FSDP: the store holds this rank's slice, made a DTensor again on restore


def _live_tensors(pl_module) -> list[torch.Tensor]:
    """The parameters and buffers; under FSDP each rank's own slices: a snapshot never gathers a whole tensor."""
    return [local(p.detach()) for p in pl_module.parameters()] + [local(b) for b in pl_module.buffers()]


def capture(trainer, pl_module, detectors: dict | None = None, store=None) -> Snapshot:
    """Copy the current state into `store` (a new `HostBuffers` when None); asynchronous: `store.wait_written()`
    before anything changes the weights or the optimizer state."""
    tensors = _live_tensors(pl_module)
    n_weights = len(tensors)

    def slot(t: torch.Tensor) -> _Slot:
        tensors.append(local(t))
        return _Slot(len(tensors) - 1, sharding(t))

    optim = [apply_to_collection(opt.state_dict(), torch.Tensor, slot) for opt in trainer.optimizers]
    store = store or HostBuffers()
    store.write(tensors)
    step, applied = trainer.global_step, pl_module.applied_steps()
    return Snapshot(step, applied, store, n_weights, optim, rng_state(), detectors or {})


def restore_weights_and_optimizer(trainer, pl_module, snap: Snapshot) -> None:
    """Put the snapshot's weights, buffers and optimizer state back into the live objects (each rank its own)."""
    reshard(pl_module)  # FSDP: the next forward gathers the restored shards
    with torch.no_grad():
        for t, b in zip(_live_tensors(pl_module), snap.store.held()):
            t.copy_(b)
    # Fresh tensors (load_state_dict keeps one already on the device): training never writes into the snapshot.
    tensors = snap.store.read(snap.n_weights, copy=True)
    for opt, state in zip(trainer.optimizers, snap.optim):
        restored = apply_to_collection(
            state, _Slot, lambda s: from_local(tensors[s.index - snap.n_weights], s.sharding)
        )
        opt.load_state_dict(restored)


class Recovery:
    def __init__(
        self,
        every_n_steps: int = 25,
        keep: int = 2,
        max_rollbacks: int = 5,
        same_place_steps: int | None = None,
        skip_steps: int | None = None,
        lr_backoff: float | None = 0.5,
        final_window: int = 20,
        final_margin: float = 0.25,
        store: str = "auto",
    ) -> None:
        key = "callbacks.stability.recovery"
        if store not in STORES:
            raise ConfigError(f"{key}.store={store!r} is not allowed; use one of: {', '.join(STORES)}")
        if every_n_steps < 0 or keep < 1 or max_rollbacks < 0:
            raise ConfigError(f"{key}: every_n_steps >= 0 (0: no snapshots), keep >= 1 and max_rollbacks >= 0")
        if lr_backoff is not None and not 0 < lr_backoff <= 1:
            raise ConfigError(f"{key}.lr_backoff={lr_backoff} must be in (0, 1], or null to never lower the LR")
        self.every_n_steps, self.keep, self.max_rollbacks = int(every_n_steps), int(keep), int(max_rollbacks)
        span = max(self.every_n_steps, 10)
        self.same_place_steps = int(same_place_steps if same_place_steps is not None else 2 * span)
        self.skip_steps = int(skip_steps if skip_steps is not None else span)
        self.lr_backoff = lr_backoff
        self.final_window, self.final_margin = int(final_window), float(final_margin)
        self.store = store
        self.where: str | None = None  # memory | disk: where new snapshots go (auto: decided at the first one)
        self._taken_at = self._interval = None  # perf_counter() at the last snapshot; seconds between the last two
        self._flusher: ThreadPoolExecutor | None = None  # saves and syncs the snapshot files in the background
        self._files, self._folder = 0, None  # the files made in the run's stability/snapshots/
        self.good: deque[Snapshot] = deque()
        self.candidate: Snapshot | None = None
        self._spare: Snapshot | None = None  # the storage of a dropped snapshot, for the next one
        # The fit's first known-good snapshot, held beyond `keep` while the caller may rewind to it (`rewind`):
        # one taken at most `hold_until` applied steps in, until the run is past them (the caller releases it).
        self.hold_until, self.first = -1, None
        self.pinned: Snapshot | None = None  # held beyond `keep` for a forecast (`pin`)
        self.rollbacks = self.strikes = 0  # strikes: rollbacks in a row at the same place
        self.last_onset: int | None = None
        self.skip_until = -1  # steps before this one are skipped (a longer data window after a repeated rollback)
        self.recent: deque[float] = deque(maxlen=self.final_window)
        self.best = math.inf  # best median of `final_window` finite losses since the last restore
        self.restored: dict | None = None  # the last restore: step, to_step, the best it threw away

    def maybe_snapshot(self, trainer, pl_module, checks=()) -> None:
        """At the start of a step, every `every_n_steps`: copy the state, and the `window_state` of each check that
        keeps one (what it has seen of the weights, e.g. the spike detector's window), so a rollback restores it."""
        step = trainer.global_step
        taken = (self.candidate, *self.good)  # the accumulated micro-batches of one step: taken at the first
        if not self.every_n_steps or step % self.every_n_steps or any(s and s.step == step for s in taken):
            return
        if self.where is None:  # `auto`: on a CPU, host memory is training memory
            on_cpu = all(p.device.type == "cpu" for p in pl_module.parameters())
            self.where = self.store if self.store != "auto" else ("disk" if on_cpu else "memory")
        # A candidate never confirmed (its step's value not read yet) is replaced by the newer one.
        reuse, self._spare = self._spare or self.candidate, None
        store = reuse.store if reuse is not None else None
        if store is not None and store.kind != self.where:
            store.close()  # the snapshots moved to host memory: a file is not reused
            store = None
        detectors = {c.name: copy.deepcopy(c.window_state()) for c in checks if hasattr(c, "window_state")}
        now = time.perf_counter()
        self._interval, self._taken_at = (now - self._taken_at if self._taken_at else None), now
        try:
            self.candidate = capture(trainer, pl_module, detectors, store or self._new_store(trainer))
        except OSError as err:  # a full or read-only disk: training goes on, its snapshots in host memory
            self._to_memory(f"a snapshot file failed ({err})")
            if store is not None:
                store.close()
            self.candidate = capture(trainer, pl_module, detectors)

    def written(self) -> None:
        """The snapshot under way has read the live tensors. Under `store: auto` a write that held the update up
        more than `SLOW_WRITE` of the time between snapshots, and `SLOW_WRITE_MIN_S`, moves them to host memory."""
        c = self.candidate
        if c is None or c.store.kind != "disk":
            return
        start = time.perf_counter()
        try:
            c.store.wait_written()
        except OSError as err:  # the disk filled up under the write: this snapshot is lost, training goes on
            self._to_memory(f"a snapshot file failed ({err})")
            c.store.close()
            self.candidate = None
            return
        waited = time.perf_counter() - start
        if self.store == "auto" and waited > max(SLOW_WRITE * (self._interval or math.inf), SLOW_WRITE_MIN_S):
            self._to_memory(
                f"writing a snapshot file held the update up {waited:.2f} s, more than {SLOW_WRITE:.0%} of the "
                f"{self._interval:.1f} s between snapshots"
            )

    def _to_memory(self, why: str) -> None:
        if self.where != "memory":
            log.warning("%s: snapshots are kept in host memory from here on", why)
            self.where = "memory"

    def _new_store(self, trainer) -> HostBuffers | SnapshotFile:
        if self.where == "memory":
            return HostBuffers()
        folder = self._folder = stability_dir(trainer) / "snapshots"
        if self._flusher is None:
            self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="steadylm-snapshot-sync")
            for stale in folder.glob(f"rank{trainer.global_rank}-*.bin"):  # left by a run that was killed
                stale.unlink(missing_ok=True)
        self._files += 1
        return SnapshotFile(folder / f"rank{trainer.global_rank}-{self._files}.bin", self._flusher)

    def close(self) -> None:
        """The fit is over: every snapshot's file is removed (`good` stays, as a record of the steps)."""
        for snap in filter(None, (self.candidate, *self.good, self._spare, self.first, self.pinned)):
            snap.store.close()  # one held twice: closing again is a no-op
        self.candidate = self._spare = None
        if self._flusher is not None:
            self._flusher.shutdown(wait=True)
            self._flusher = None
            with contextlib.suppress(OSError):  # another rank's files may still be there
                self._folder.rmdir()

    def confirm(self, m: Measurement, suspect: bool) -> None:
        """The measurement of step `m.step` has been judged: its snapshot is known-good, or dropped."""
        c = self.candidate
        if c is not None and c.step == m.step:
            self.candidate = None
            if not m.nonfinite and not suspect:
                self.good.append(c)
                if self.first is None and c.applied <= self.hold_until:
                    self.first = c
                if len(self.good) > self.keep:
                    self._release(self.good.popleft())
            else:
                self._release(c)
        if not m.nonfinite:
            self.recent.append(m.loss)
            if len(self.recent) == self.recent.maxlen:
                self.best = min(self.best, statistics.median(self.recent))

    def newest_good(self, before: int | None = None, older: bool = False) -> Snapshot | None:
        found = [s for s in self.good if before is None or s.step <= before]
        return found[-2] if older and len(found) > 1 else (found[-1] if found else None)

    def rollback(self, trainer, pl_module, optimizer, onset: int) -> dict | None:
        """Restore a state from before step `onset`, escalating when rollbacks repeat at the same place; None when
        the budget is spent or nothing is there (the caller stops). The result: `source`, `to_step`, `applied`,
        `detectors` (the spike window) and any escalation (`skip_more_steps`, `lr_backoff` for the LR scale)."""
        if self.rollbacks >= self.max_rollbacks:
            return None
        same_place = self.last_onset is not None and abs(onset - self.last_onset) <= self.same_place_steps
        strikes = self.strikes + 1 if same_place else 1
        if (snap := self.newest_good(before=onset, older=strikes >= 2)) is not None:
            restored = self._restore(trainer, pl_module, snap)
        elif (restored := disk.rollback(trainer, pl_module, optimizer, onset)) is None:
            return None
        self.rollbacks += 1
        self.strikes, self.last_onset = strikes, onset
        self._judge_from(trainer.global_step, restored["to_step"])
        skipped = trainer.global_step + 1 - restored["to_step"]
        restored.update(
            rollbacks=self.rollbacks, budget=self.max_rollbacks, strikes=strikes, skipped_data_steps=skipped
        )
        if strikes >= 2 and self.skip_steps:
            extra = self.skip_steps * 2 ** (strikes - 2)
            self.skip_until = trainer.global_step + 1 + extra
            restored["skip_more_steps"] = extra
        if strikes >= 3 and self.lr_backoff is not None and self.lr_backoff < 1:
            restored["lr_backoff"] = self.lr_backoff
        return restored

    def _restore(self, trainer, pl_module, snap: Snapshot) -> dict:
        restore_weights_and_optimizer(trainer, pl_module, snap)
        set_rng_state(snap.rng)
        # Newer snapshots hold the weights being abandoned.
        while self.good and self.good[-1].step > snap.step:
            self._release(self.good.pop())
        if not self.good:  # the held first snapshot, evicted by newer ones and now the newest again
            self.good.append(snap)
        self._release(self.candidate)
        self.candidate = None
        source = "memory" if snap.store.kind == "memory" else "snapshot_file"
        return {"source": source, "to_step": snap.step, "applied": snap.applied, "detectors": snap.detectors}

    def _release(self, snap: Snapshot | None) -> None:
        """`snap` is let go: unless it is still good, first or pinned, its storage serves the next snapshot (the
        storage it replaces is closed)."""
        if snap is None or any(snap is s for s in (self.first, self.pinned, *self.good)):
            return
        if self._spare is not None and self._spare is not snap:
            self._spare.store.close()
        self._spare = snap

    def pin(self, before: int) -> None:
        """Hold the newest good snapshot taken at or before `before` beyond `keep` (a forecast's: a rewind for the
        alarm that may follow finds the weights from before the growth), until `unpin`."""
        self.unpin()
        self.pinned = self.newest_good(before=before)

    def unpin(self) -> None:
        pinned, self.pinned = self.pinned, None
        self._release(pinned)

    def release_first(self) -> None:
        """Stop holding the first snapshot beyond `keep` (its buffers serve the next snapshot)."""
        first, self.first = self.first, None
        self._release(first)

    def rewind(self, trainer, pl_module, before: int, latest: int, to_first: bool = False) -> dict | None:
        """Restore the newest good snapshot taken at or before `before`, else the earliest (the held first and the pinned
        ones included) at or before `latest`; `to_first`: the held first one when there is one. No strike, no budget
        (the caller bounds it). None when memory holds none: the caller keeps its weights."""
        kept = [s for s in (self.first, self.pinned, *self.good) if s is not None and s.step <= latest]
        first = self.first if to_first and any(s is self.first for s in kept) else None
        snap = first or self.newest_good(before=before) or min(kept, key=lambda s: s.step, default=None)
        if snap is None:
            return None
        restored = self._restore(trainer, pl_module, snap)
        self._judge_from(trainer.global_step, snap.step)
        return {**restored, "skipped_data_steps": trainer.global_step - snap.step}

    def _judge_from(self, step: int, to_step: int) -> None:
        """Judge the run from the state restored at `step` (back to `to_step`); the abandoned best is kept only to
        say whether the run got back to it."""
        bests = [b for b in (self.best, (self.restored or {}).get("best_before")) if b is not None and math.isfinite(b)]
        best = min(bests, default=None)
        self.restored = {"step": int(step), "to_step": int(to_step), "best_before": best}
        self.recent.clear()
        self.best = math.inf

    def final_verdict(self) -> Verdict | None:
        """A run that ends far above its best loss has diverged, even with no event on the way."""
        if len(self.recent) < self.recent.maxlen or not math.isfinite(self.best):
            return None
        final = statistics.median(self.recent)
        if final <= self.best * (1 + self.final_margin):
            return None
        reason = (
            f"final training loss {final:.3f} (median of the last {len(self.recent)} steps) is "
            f"{final / self.best - 1:.0%} above the run's best {self.best:.3f} (limit {self.final_margin:.0%})"
        )
        return Verdict("stop", "final_loss", {"final": final, "best": self.best}, reason=reason)

    def unrecovered(self, step: int) -> dict | None:
        """At the end: the last restore, when the run ended before its loss came back to the best before it."""
        r = self.restored
        if r is None or r["best_before"] is None:
            return None
        final = statistics.median(self.recent) if self.recent else None
        if final is not None and final <= r["best_before"]:
            return None
        return {**r, "steps_after": int(step) - r["step"], "final": final, "lost_steps": r["step"] - r["to_step"]}

    def state_dict(self) -> dict:
        best = self.best if math.isfinite(self.best) else None
        return {**{k: getattr(self, k) for k in _STATE}, "recent": list(self.recent), "best": best}

    def load_state_dict(self, state: dict) -> None:
        for k in _STATE:
            setattr(self, k, state.get(k, getattr(self, k)))
        self.recent = deque(state.get("recent", []), maxlen=self.final_window)
        self.best = state["best"] if state.get("best") is not None else math.inf
