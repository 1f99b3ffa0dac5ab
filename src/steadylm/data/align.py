"""`data.align=doc`: train windows laid out per document, as modded-nanogpt and nanochat start sequences at a BOS.

Segment j of a shard runs from boundary b[j] (position 0 or an `eos_id`, the previous document's end, which plays
BOS) to b[j + 1]; its windows start at b[j], b[j] + T, ... and its last one is padded (targets ignored) rather than
running into the next document. Every target position 1 .. n - 1 of a shard is then predicted exactly once per
epoch; the price is the padding, logged at startup. Loaded only when on."""

from __future__ import annotations

import logging

import numpy as np

from steadylm.data.shards import _SCAN_BLOCK, REWRITE, ShardInfo, open_tokens
from steadylm.errors import DataError

log = logging.getLogger("steadylm")


def doc_bounds(info: ShardInfo) -> np.ndarray:
    """0, every `eos_id` position and n - 1, sorted and distinct: read in blocks, so a large shard is never whole
    in memory; 8 bytes per document are kept."""
    ds, found = open_tokens(info.path), [np.zeros(1, np.int64), np.full(1, info.n_tokens - 1, np.int64)]
    with ds.file:
        for start in range(0, info.n_tokens, _SCAN_BLOCK):
            try:
                found.append(np.flatnonzero(ds[start : start + _SCAN_BLOCK] == info.eos_id) + start)
            except (OSError, ValueError) as e:
                raise DataError(
                    f"{info.path}: unreadable tokens at offset {start} ({type(e).__name__}); {REWRITE}"
                ) from None
    return np.unique(np.concatenate(found))


class DocLayout:
    """Each shard's segment bounds and the first window of each segment, computed once per process."""

    def __init__(self, infos: list[ShardInfo], T: int):
        self.T, self.bounds = T, [doc_bounds(i) for i in infos]
        self.firsts = [np.concatenate([[0], np.cumsum(-(-np.diff(b) // T))]) for b in self.bounds]
        self.counts = [int(f[-1]) for f in self.firsts]
        targets = sum(int(b[-1] - b[0]) for b in self.bounds)
        self.padding = 1 - targets / max(sum(self.counts) * T, 1)
        log.info(
            "data.align=doc: %d train windows over %d document segments at T=%d, %.1f%% of their targets are padding",
            sum(self.counts),
            sum(len(b) - 1 for b in self.bounds),
            T,
            100 * self.padding,
        )

    def place(self, shard: int, window: int) -> tuple[int, int]:
        """A shard's window -> (token offset of its first token, its real targets: T, fewer in a document's last)."""
        first, b = self.firsts[shard], self.bounds[shard]
        j = int(np.searchsorted(first, window, side="right")) - 1
        start = int(b[j]) + (window - int(first[j])) * self.T
        return start, min(self.T, int(b[j + 1]) - start)
