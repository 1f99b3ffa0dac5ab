"""Training windows over HDF5 shards: window i of a shard is `tokens[i*T : i*T + T + 1]`, -1 is padding (y = -100).

Each process opens its own files (handles are never pickled). Every window is checked as it is read, so a bad id
or a short read is a `ShardReadError` naming file and offset, not a CUDA error."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from steadylm.data.sampler import PAD_INDEX
from steadylm.data.shards import REWRITE, ShardInfo, open_tokens, read_shard_info
from steadylm.errors import DataError, one_line
from steadylm.model.gpt import IGNORE_INDEX


class ShardReadError(DataError):
    """A bad window found mid-run; one re-raised from a worker ("Caught ... Original Traceback ...") keeps its line."""

    def __init__(self, message: str):
        super().__init__(one_line(message))


class TokenWindows(Dataset):
    def __init__(
        self, paths, context_length: int, *, infos: list[ShardInfo] | None = None, model_vocab_size=None, align="none"
    ):
        self.paths = [Path(p) for p in paths]
        self.context_length = T = int(context_length)  # > 0: model.context_length's rule
        infos = [read_shard_info(p) for p in self.paths] if infos is None else infos
        # Ids at or above the limit are refused as they are read: the model's vocabulary when known.
        self.model_vocab_size = None if model_vocab_size is None else int(model_vocab_size)
        self.limits = [int(i.vocab_size) if model_vocab_size is None else self.model_vocab_size for i in infos]
        self.docs = None  # align="doc": windows per document (data/align.py, loaded only then)
        if align == "doc":
            from steadylm.data.align import DocLayout

            self.docs = DocLayout(infos, T)
        counts = self.docs.counts if self.docs else [max((i.n_tokens - 1) // T, 0) for i in infos]
        self.starts = np.cumsum([0, *counts], dtype=np.int64)  # starts[s]: shard s's first window; [-1]: all
        self.n_total = int(self.starts[-1])
        self._pid, self._handles = os.getpid(), {}  # shard number -> open `tokens`, this process's only

    def __len__(self) -> int:
        return self.n_total

    def locate(self, index: int) -> tuple[int, int, int]:
        """Global window index -> (shard number, token offset of its first token, its real targets: T unless padded)."""
        s = int(np.searchsorted(self.starts, index, side="right")) - 1
        w, T = int(index) - int(self.starts[s]), self.context_length
        return (s, *(self.docs.place(s, w) if self.docs else (w * T, T)))

    def __getitem__(self, index):
        return self.__getitems__([index])[0]

    def __getitems__(self, indices) -> list:
        """[(x, y)] for a batch of window indices: located at once, read into one array, checked row by row."""
        T, idx, n = self.context_length, np.asarray(indices, dtype=np.int64).reshape(-1), self.n_total
        if (outside := (idx < PAD_INDEX) | (idx >= n)).any():
            raise IndexError(f"window {int(idx[outside][0])} out of range for {n} windows (-1 is padding)")
        if self._pid != os.getpid():  # inherited through fork: never reuse another process's handle
            self._pid, self._handles = os.getpid(), {}
        real = idx != PAD_INDEX
        shards = np.searchsorted(self.starts, idx[real], side="right") - 1
        local = idx[real] - self.starts[shards]
        buf, targets = np.zeros((len(idx), T + 1), dtype=np.int64), np.zeros((len(idx), 1), dtype=np.int64)
        for row, s, w in zip(np.flatnonzero(real).tolist(), shards.tolist(), local.tolist()):
            off, k = self.docs.place(s, w) if self.docs else (w * T, T)  # k: real targets, T unless padded
            path, limit = self.paths[s], self.limits[s]
            try:
                if s not in self._handles:
                    self._handles[s] = open_tokens(path)
                raw = self._handles[s][off : off + k + 1]
            except DataError as e:
                raise ShardReadError(str(e)) from None
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ShardReadError(
                    f"{path}: unreadable tokens at token offset {off} ({type(e).__name__}: "
                    f"{str(e).splitlines()[0]}); {REWRITE}"
                ) from None
            if raw.shape != (k + 1,):
                raise ShardReadError(
                    f"{path}: window at token offset {off} has {raw.size} of {k + 1} tokens (the file is shorter "
                    f"than its n_tokens attribute: truncated?); {REWRITE}"
                )
            if int(raw.max()) >= limit:
                bad = int(np.argmax(raw >= limit))
                what = "model.vocab_size" if self.model_vocab_size is not None else "the shard's vocab_size"
                raise ShardReadError(
                    f"{path}: token id {int(raw[bad])} at token offset {off + bad} is >= {what} {limit}; the shard "
                    "is corrupt or was made with another tokenizer: re-run `python -m steadylm.data.prepare`"
                )
            buf[row, : k + 1], targets[row] = raw, k
        y = buf[:, 1:].copy()
        y[np.arange(T) >= targets] = IGNORE_INDEX  # padding rows, and a document's padded tail
        return list(zip(torch.from_numpy(buf[:, :-1]), torch.from_numpy(y)))

    def __getstate__(self):
        return {**self.__dict__, "_handles": {}}

    def close(self) -> None:
        for ds in self._handles.values():
            with contextlib.suppress(Exception):
                ds.file.close()
        self._handles = {}
