"""`data.sources`: several prepared sources trained together at fixed token shares, as one stream of windows.

The stream is a pure function of the seed and the global position, like one source's epoch order, so any step's
windows can be recomputed, a resume continues exactly, and every rank agrees without talking:

- Which source position q draws from is a fixed table of `BLOCK` positions, repeated: source s holds its weight's
  share of each block (largest remainder), spread evenly through it (smooth weighted round robin). Over any run of
  positions the shares are off by at most a window or two per source, far under 1 % of a 100-step span.
- Which window of s it draws is s's own count of draws before q: draw c is window `perm(s, e)(c mod size)` of s's
  epoch e = c // size, a keyed Feistel order per (seed, source name, epoch). A small source starts its next epoch on
  its own while a large one is still in its first.

A resume whose `data.sources` differ from the checkpoint's (weights, sources added or dropped) anchors the stream
where the checkpoint left it: from there the table restarts at the new shares and each source's count goes on from
its draws so far, so no source repeats or skips a window (data/mixture_resume.py).

Windows of all sources live in one id space (source s's ids start at `offsets[s]`), one `TokenWindows` over every
source's shards, so reading, checking and the suspects' locations work as for one source.
"""

from __future__ import annotations

import math
import zlib
from pathlib import Path

import numpy as np

from steadylm.data.sampler import PAD_INDEX, EpochBatchSampler, FeistelPermutation, _mix64
from steadylm.errors import ConfigError

BLOCK = 1000  # positions per repeat of the source table: a weight is rounded to 1/BLOCK (0.1 %) at most


def quotas(weights: list[float], block: int = BLOCK) -> np.ndarray:
    """Each source's whole share of `block` positions, summing to `block` (largest remainder)."""
    w = np.asarray(weights, dtype=np.float64) / float(sum(weights))
    exact = w * block
    out = np.floor(exact).astype(np.int64)
    out[np.argsort(-(exact - out), kind="stable")[: block - int(out.sum())]] += 1
    return out


def block_table(quota: np.ndarray) -> np.ndarray:
    """The source of each position of a block, spread evenly (smooth weighted round robin, as nginx balances)."""
    current, table = np.zeros(len(quota), dtype=np.int64), np.empty(int(quota.sum()), dtype=np.int64)
    for r in range(len(table)):
        current += quota
        table[r] = s = int(np.argmax(current))
        current[s] -= len(table)
    return table


def check_sources(sources) -> dict[str, tuple[Path, float]] | None:
    """`data.sources` as {name: (folder, weight)}: one line for an unknown key, a missing dir, a weight that is not a
    finite number >= 0, weights that are all 0, or a weight > 0 too small for one position of the table (never drawn:
    0 says "validate on it only" on purpose)."""
    if not sources:
        return None
    out = {}
    for name, spec in dict(sources).items():
        spec = dict(spec or {})
        if unknown := sorted(set(spec) - {"dir", "weight"}):
            raise ConfigError(f"data.sources.{name}.{unknown[0]} is not a source key; a source has dir and weight")
        if spec.get("dir") is None:
            raise ConfigError(f"data.sources.{name}.dir is not set: the folder of that source's prepared shards")
        weight = spec.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight < math.inf:
            raise ConfigError(f"data.sources.{name}.weight={weight!r} is not allowed; it must be a finite number >= 0")
        out[str(name)] = (Path(str(spec["dir"])).expanduser(), float(weight))
    weights = [w for _, w in out.values()]
    if not sum(weights) > 0:
        raise ConfigError("data.sources: every weight is 0; give at least one source a weight > 0")
    for (name, (_, weight)), quota in zip(out.items(), quotas(weights)):
        if weight > 0 and not quota:
            least = (sum(weights) - weight) / (BLOCK - 1)  # the weight whose share is one position of the table
            unit = 10.0 ** (math.floor(math.log10(least)) - 2)
            least = math.ceil(least / unit) * unit  # 3 digits, rounded up
            raise ConfigError(
                f"data.sources.{name}.weight={weight:g} is {weight / sum(weights):.3%} of the total, under the "
                f"{1 / BLOCK:.1%} of one position in {BLOCK:,}, so {name} would never be drawn; raise it to at least "
                f"{least:.3g}, or set it to 0 to only validate on it"
            )
    return out


def no_val_window(name: str, val: list, context_length: int) -> str:
    """The line for a source whose val shards hold no window (`val: ShardInfo`s): it would score nothing."""
    longest = max(val, key=lambda i: i.n_tokens)
    return (
        f"{longest.path}: source {name!r} has no val window: its longest val shard has {longest.n_tokens} tokens, "
        f"fewer than model.context_length + 1 = {context_length + 1}, so val/loss/{name} would read 0; prepare it "
        f"with a larger data.val_fraction or more text, or lower model.context_length"
    )


class MixtureOrder:
    """Global stream position -> window id (in the sources' joint id space)."""

    def __init__(self, sizes: list[int], weights: list[float], seed: int, shuffle: bool = True, names=None):
        self.names = [str(n) for n in names] if names is not None else [str(s) for s in range(len(sizes))]
        self.sizes = np.asarray(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.quota = quotas(weights)
        self.table = block_table(self.quota)
        self.before = np.zeros((len(sizes), BLOCK + 1), dtype=np.int64)  # [s, r]: s's positions in table[:r]
        for s in range(len(sizes)):
            self.before[s, 1:] = np.cumsum(self.table == s)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self._perms: dict[tuple[int, int], FeistelPermutation] = {}
        # (position, each source's draws before it): a resume under other sources (data/mixture_resume.py); None: 0
        self.anchor: tuple[int, np.ndarray] | None = None

    def _from_anchor(self, positions) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Whole tables since the anchor, the place in the table, and the anchor's draws per source."""
        start, drawn = self.anchor if self.anchor is not None else (0, np.zeros(len(self.sizes), dtype=np.int64))
        block, r = np.divmod(np.asarray(positions, dtype=np.int64) - start, BLOCK)
        return block, r, drawn

    def drawn(self, position: int) -> list[int]:
        """Each source's draws before stream position `position` (what a checkpoint records)."""
        block, r, drawn = self._from_anchor(position)
        return (drawn + block * self.quota + self.before[:, r]).tolist()

    def __call__(self, positions) -> np.ndarray:
        block, r, drawn = self._from_anchor(positions)
        s = self.table[r]
        draw = drawn[s] + block * self.quota[s] + self.before[s, r]  # s's draws before q
        epoch, i = np.divmod(draw, self.sizes[s])
        local = i.copy()
        if self.shuffle:
            for key in {(int(a), int(b)) for a, b in zip(s, epoch)}:
                pick = (s == key[0]) & (epoch == key[1])
                local[pick] = self._perm(*key)(i[pick])
        return self.offsets[s] + local

    def _perm(self, source: int, epoch: int) -> FeistelPermutation:
        if (source, epoch) not in self._perms:
            if len(self._perms) > 64:
                self._perms.clear()
            name = zlib.crc32(self.names[source].encode())  # by name: a source keeps its order among others
            key = _mix64(_mix64(self.seed) ^ _mix64(name + 1)) ^ epoch
            self._perms[(source, epoch)] = FeistelPermutation(int(self.sizes[source]), key)
        return self._perms[(source, epoch)]


class MixtureBatchSampler(EpochBatchSampler):
    """`EpochBatchSampler` whose epoch is a stretch of the mixture's stream: as many positions as the sources have
    windows, rounded up to whole optimizer steps, so no position is padding; epoch e covers stream positions
    [e·n, (e + 1)·n). With the windows per step fixed (`data.global_batch_tokens`), n and so every step's windows are
    the same on any number of ranks. Batching, ranks, resume and `batch_windows` are the base class's."""

    def __init__(self, order: MixtureOrder, batch_size: int, *, world_size: int = 1, step_batches: int = 1, **kwargs):
        N = int(batch_size) * int(world_size) * int(step_batches)
        n = -(-int(order.sizes.sum()) // N) * N
        super().__init__(n, batch_size, world_size=world_size, step_batches=step_batches, **kwargs)
        self.order = order

    def global_windows(self, positions) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        out = np.full(pos.shape, PAD_INDEX, dtype=np.int64)
        real = pos < self.n_windows
        out[real] = self.order(self.epoch * self.n_windows + pos[real])
        return out

    def state_at(self, epoch: int, batches_done: int, step: int | None = None) -> dict:
        """The base's, and the mixture it was read from: each source's name, size, share of the table and draws
        before this position, the anchor, and the optimizer `step` (a resume compares them, data/mixture_resume.py)."""
        order, at = self.order, int(epoch) * self.n_windows + int(batches_done) * self.global_batch
        anchor = None
        if order.anchor is not None:  # as (epoch, position in it): the base counts a position so
            anchor = [*divmod(int(order.anchor[0]), self.n_windows), order.anchor[1].tolist()]
        mixture = {"names": order.names, "sizes": order.sizes.tolist(), "quota": order.quota.tolist()}
        mixture |= {"anchor": anchor, "drawn": order.drawn(at), "step": step}
        return {**super().state_at(epoch, batches_done, step), "mixture": mixture}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict({k: v for k, v in state.items() if k != "mixture"})
        from steadylm.data.mixture_resume import continue_mixture  # loaded only by a resume

        continue_mixture(self, state.get("mixture"))
