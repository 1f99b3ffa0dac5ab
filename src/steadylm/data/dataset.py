"""Fixed-length training windows over HDF5 token shards, safe to use in DataLoader workers.

Window i of a shard is `tokens[i*T : i*T + T + 1]`; windows never cross shards, so every sample
is `T+1` contiguous tokens of one file. Files are opened lazily in whichever process reads
them (handles keyed by pid) and are never pickled: a DataLoader worker always opens its own.
Index -1 is padding (from `EpochBatchSampler`): x = zeros, y = -100 (ignored by the loss).

Every window is checked as it is read (one `max()` over T+1 ids, small beside the read): an id
the model cannot embed, a short read from a truncated file, or an unreadable chunk is a `ShardReadError`
naming the file and token offset, never a CUDA index error many steps later.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from steadylm.data.sampler import PAD_INDEX
from steadylm.data.shards import ShardInfo, open_tokens, read_shard_info
from steadylm.errors import DataError

IGNORE_INDEX = -100  # the target of a padding position: cross-entropy leaves it out
_TORCH_WRAPPED = "Original Traceback"


class ShardReadError(DataError):
    """A bad window found mid-run. Raised inside a DataLoader worker, torch re-raises it in the main process
    as `ShardReadError("Caught ... Original Traceback ...")`; the constructor keeps only the original
    sentence, so the entry point still prints one line."""

    def __init__(self, message: str):
        message = str(message)
        if _TORCH_WRAPPED in message:
            tag = f"{type(self).__name__}: "
            last = [ln for ln in message.splitlines() if tag in ln]
            if last:
                message = last[-1].split(tag, 1)[1]
        super().__init__(message)


class TokenWindows(Dataset):
    def __init__(
        self, paths, context_length: int, *, infos: list[ShardInfo] | None = None, model_vocab_size: int | None = None
    ):
        self.paths = [Path(p) for p in paths]
        self.context_length = int(context_length)
        if self.context_length < 1:
            raise ValueError(f"context_length must be >= 1, got {context_length}")
        if infos is None:
            infos = [read_shard_info(p) for p in self.paths]
        self.n_tokens = np.array([i.n_tokens for i in infos], dtype=np.int64)
        # Ids at or above the limit are refused as they are read: the model's vocabulary when known.
        self.model_vocab_size = None if model_vocab_size is None else int(model_vocab_size)
        self.vocab_sizes = [int(i.vocab_size) for i in infos]
        T = self.context_length
        self.n_windows = np.maximum((self.n_tokens - 1) // T, 0)
        self.cum_windows = np.cumsum(self.n_windows)  # cum[s] = windows in shards 0..s
        self.n_total = int(self.cum_windows[-1]) if len(self.cum_windows) else 0
        self._handles: dict[tuple[int, int], object] = {}

    def __len__(self) -> int:
        return self.n_total

    def locate(self, index: int) -> tuple[int, int]:
        """Global window index -> (shard number, token offset of the window's first token)."""
        s = int(np.searchsorted(self.cum_windows, index, side="right"))
        first = int(self.cum_windows[s - 1]) if s > 0 else 0
        return s, (index - first) * self.context_length

    def shard_span(self, index: int) -> tuple[str, int, int]:
        """Global window index -> (shard file name, first token offset, end offset, exclusive)."""
        s, off = self.locate(index)
        return self.paths[s].name, off, off + self.context_length + 1

    def _tokens(self, s: int):
        key = (os.getpid(), s)
        ds = self._handles.get(key)
        if ds is None:
            if any(k[0] != key[0] for k in self._handles):
                self._handles = {}  # inherited through fork: never reuse another process's handle
            ds = self._handles[key] = open_tokens(self.paths[s])
        return ds

    def __getitem__(self, index):
        index = int(index)
        T = self.context_length
        if index == PAD_INDEX:
            return torch.zeros(T, dtype=torch.int64), torch.full((T,), IGNORE_INDEX, dtype=torch.int64)
        if not 0 <= index < self.n_total:
            raise IndexError(f"window {index} out of range for {self.n_total} windows (-1 is padding)")
        s, off = self.locate(index)
        raw = self._read(s, off)
        w = torch.from_numpy(raw.astype(np.int64))
        return w[:-1].clone(), w[1:].clone()

    def _read(self, s: int, off: int) -> np.ndarray:
        T, path = self.context_length, self.paths[s]
        try:
            raw = self._tokens(s)[off : off + T + 1]
        except DataError as e:
            raise ShardReadError(str(e)) from None
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ShardReadError(
                f"{path}: unreadable tokens at token offset {off} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                "re-run `python -m steadylm.data.prepare` to rewrite it"
            ) from None
        if raw.shape != (T + 1,):
            raise ShardReadError(
                f"{path}: window at token offset {off} has {raw.size} of {T + 1} tokens (the file is shorter than "
                f"its n_tokens attribute: truncated?); re-run `python -m steadylm.data.prepare` to rewrite it"
            )
        limit = self.model_vocab_size if self.model_vocab_size is not None else self.vocab_sizes[s]
        if int(raw.max()) >= limit:
            bad = int(np.argmax(raw >= limit))
            what = "model.vocab_size" if self.model_vocab_size is not None else "the shard's vocab_size"
            raise ShardReadError(
                f"{path}: token id {int(raw[bad])} at token offset {off + bad} is >= {what} {limit}; "
                "the shard is corrupt or was made with another tokenizer: re-run `python -m steadylm.data.prepare`"
            )
        return raw

    def __getitems__(self, indices) -> list:
        return [self[i] for i in indices]

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state

    def close(self) -> None:
        for ds in self._handles.values():
            try:
                ds.file.close()
            except Exception:
                pass
        self._handles = {}
