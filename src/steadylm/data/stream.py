"""`StreamDataModule` (`data=hf_stream`): text streamed through `datasets`, tokenized and packed on the fly.

`datasets.load_dataset(name, config, split=split, streaming=True)` reads a hub dataset, a local dataset
folder or a builder over local files (`name=json`, `data_files=...`); nothing is prepared beforehand. Each
document's tokens and an end-of-text id are concatenated and cut into windows of `context_length + 1`
tokens (no window crosses an epoch's end). The first `val_windows` windows are the val split; training
reads the rest, again from the start when the stream ends. Global window `w` goes to rank `(w // batch_size)
% world_size`, so window ids are known (`window_ids`) and a resume skips exactly the windows already trained
on (`state_dict`: the batches done), on any number of ranks (`align_resume`). A missing dataset, config, split or text field is one `DataError`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset

from steadylm.compat import batches_processed
from steadylm.data.source import check_pack
from steadylm.data.tokenizer import get_tokenizer
from steadylm.errors import ConfigError, DataError
from steadylm.model.config import GPTConfig


def open_stream(name: str, config: str | None, split: str, data_files=None, where: str | None = None) -> Any:
    """The streaming `datasets` split, or one line naming what is missing (dataset, config or split).

    `where` names the input in the message (prepare: `hf:SPEC`); by default the `data=hf_stream` keys."""
    try:
        import datasets
    except ImportError:
        raise DataError(
            f"{where or 'data=hf_stream'}: needs the datasets extra: pip install 'steadylm[datasets]'"
        ) from None
    keys = where is None
    where = where or f"data.name={name}" + (f" data.config={config}" if config else "")
    try:
        return datasets.load_dataset(name, config, split=split, data_files=data_files, streaming=True)
    except Exception as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        lower = first.lower()
        if "split" in lower:
            what = f"no split {split!r}" + (" (data.split)" if keys else "")
        elif config and "config" in lower:
            what = f"no config {config!r}" + (" (data.config)" if keys else "")
        else:
            what = "no such dataset" + (" (data.name)" if keys else "; check the name (and the network for the hub)")
        raise DataError(f"{where}: {what}: {type(e).__name__}: {first}") from None


def texts_of(rows, field: str) -> Iterator[str]:
    """Each row's `field`; a row without a string there is one `DataError` naming the row and its fields."""
    for i, row in enumerate(rows):
        text = row.get(field) if isinstance(row, dict) else None
        if not isinstance(text, str):
            fields = ", ".join(row) if isinstance(row, dict) else type(row).__name__
            raise DataError(f"row {i} has no string field {field!r} (data.text_field); its fields are {fields}")
        yield text


class PackedWindows(IterableDataset):
    """Windows of `T + 1` tokens packed from a document stream: (x, y) pairs, this rank's share, in order."""

    def __init__(self, source, T: int, tokenizer, text_field: str, start: int, stop: int | None, batch_size: int):
        self.source, self.T, self.tok, self.field = source, T, tokenizer, text_field
        self.start, self.stop, self.batch_size = start, stop, batch_size
        self.rank, self.world, self.skip = 0, 1, 0  # set by the DataModule before each iteration

    def windows(self) -> Iterator[list[int]]:
        """All windows of one pass over the stream, in order."""
        buf: list[int] = []
        for text in texts_of(self.source, self.field):
            buf.extend(self.tok.encode(text))
            buf.append(self.tok.eos_id)
            while len(buf) >= self.T + 1:
                yield buf[: self.T + 1]
                buf = buf[self.T + 1 :]

    def numbered(self) -> Iterator[tuple[int, list[int]]]:
        """(window id, window) from `start` to `stop`; with no `stop` the stream starts over, ids counting on."""
        g = 0
        while True:
            before = g
            for w in itertools.islice(self.windows(), self.start, self.stop):
                yield g, w
                g += 1
            if self.stop is not None or g == before:
                return

    def __iter__(self):
        for g, w in self.numbered():
            if g < self.skip or (g // self.batch_size) % self.world != self.rank:
                continue
            t = torch.tensor(w, dtype=torch.long)
            yield t[:-1], t[1:]


class StreamDataModule(L.LightningDataModule):
    """The stream `DataSource` (data/source.py): vocabulary and tokenizer from `data.tokenizer`, no shards."""

    def __init__(
        self,
        name: str,
        config: str | None = None,
        split: str = "train",
        text_field: str = "text",
        data_files=None,
        tokenizer: str | None = "bytes",
        val_windows: int = 64,
        batch_size: int = 16,
        context_length: int = GPTConfig.context_length,
        model_vocab_size: int | None = None,
        global_batch_tokens: int | None = None,
        num_workers: int = 0,
        align: str = "none",
        pack: str = "none",
        sources: dict | None = None,
    ):
        super().__init__()
        self.pack = check_pack(pack)
        if sources:
            raise ConfigError(
                "data.sources mixes prepared shard folders; data=hf_stream streams one dataset (prepare it)"
            )
        if num_workers:
            raise ConfigError(f"data.num_workers={num_workers}: data=hf_stream reads in the training process; set 0")
        if align != "none":
            raise ConfigError(f"data.align={align}: data=hf_stream packs the stream as it comes; doc needs shards")
        self.name, self.config, self.split, self.text_field = str(name), config, str(split), str(text_field)
        self.data_files = data_files
        self.tokenizer = get_tokenizer(tokenizer or "bytes")
        self.val_windows, self.batch_size = int(val_windows), int(batch_size)
        self.context_length = int(context_length)
        self.model_vocab_size = None if model_vocab_size is None else int(model_vocab_size)
        self.global_batch_tokens = global_batch_tokens  # startup reads it from the config (derived.py)
        self.train_set: PackedWindows | None = None
        self.val_set: PackedWindows | None = None
        self.batches_done = 0  # restored by load_state_dict: the windows a resume skips

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        if self.model_vocab_size is not None and self.tokenizer.vocab_size > self.model_vocab_size:
            raise DataError(
                f"data.tokenizer {self.tokenizer.name} has vocab_size {self.tokenizer.vocab_size} > model.vocab_size "
                f"{self.model_vocab_size}; set model.vocab_size >= {self.tokenizer.vocab_size} (or null)"
            )
        source = open_stream(self.name, self.config, self.split, self.data_files)
        args = (self.context_length, self.tokenizer, self.text_field)
        self.val_set = PackedWindows(source, *args, start=0, stop=self.val_windows, batch_size=self.batch_size)
        self.train_set = PackedWindows(source, *args, start=self.val_windows, stop=None, batch_size=self.batch_size)
        try:  # the first val window proves the stream, its field and its length, here rather than mid-run
            first = next(iter(self.val_set.windows()), None)
        except DataError as e:
            raise DataError(f"data.name={self.name} split={self.split}: {e}") from None
        if first is None:
            raise DataError(
                f"data.name={self.name} split={self.split}: fewer than model.context_length + 1 = "
                f"{self.context_length + 1} tokens in the whole stream; lower model.context_length"
            )

    def _world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return (0, 1) if trainer is None else (int(trainer.global_rank), int(trainer.world_size))

    def _loader(self, ds: PackedWindows, skip: int) -> DataLoader:
        ds.rank, ds.world = self._world()
        ds.skip = skip
        # Its own generator: building the iterator never draws from the global one (checkpointing.RNGState).
        return DataLoader(ds, batch_size=self.batch_size, generator=torch.Generator())

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return self._loader(self.train_set, self.batches_done * self.batch_size * self._world()[1])

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return self._loader(self.val_set, 0)

    # --- the DataSource members ---------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.tokenizer.vocab_size)

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name)

    @property
    def bytes_per_token(self) -> float | None:
        """UTF-8 bytes of the val windows' decoded text per token (the end-of-text ids count as tokens)."""
        self.setup(None)
        ids = [i for w in itertools.islice(self.val_set.windows(), self.val_windows) for i in w]
        return len(self.tokenizer.decode(ids).encode("utf-8")) / len(ids) if ids else None

    @property
    def n_train_windows(self) -> int | None:
        return None  # a stream does not know its length

    @property
    def document_separator(self) -> int | None:
        return self.tokenizer.eos_id if self.pack == "doc" else None

    def window_ids(self, batch_idx: int) -> list[int]:
        """Window ids of this rank's batch `batch_idx`: ids count from the first train window."""
        rank, world = self._world()
        first = (int(batch_idx) * world + rank) * self.batch_size
        return list(range(first, first + self.batch_size))

    def window_location(self, window: int) -> dict:
        return {}  # a stream window has no file offset

    def _shape(self) -> dict:
        trainer = getattr(self, "trainer", None)
        accumulate = int(trainer.accumulate_grad_batches) if trainer is not None else 1
        return {"global_batch": self.batch_size * self._world()[1], "step_batches": accumulate}

    def state_dict(self) -> dict:
        """`{"batches_done"}`: the batches each rank has trained on (a resume skips their windows), with the shape
        they were counted in (windows per micro-batch, micro-batches per step) for a resume on another machine."""
        trainer = getattr(self, "trainer", None)
        if trainer is not None and getattr(trainer, "training", False):
            return {"batches_done": batches_processed(trainer), **self._shape()}
        return {"batches_done": self.batches_done, **self._shape()}

    def align_resume(self, checkpoint: dict) -> None:
        """The checkpoint's batch counts in this run's shape (data/position.py), before Lightning loads them."""
        if (state := checkpoint.get(type(self).__qualname__)) and "batches_done" in state:
            from steadylm.data.position import align_resume  # loaded only by a resume

            shape = self._shape()
            align_resume(checkpoint, state, shape["global_batch"], shape["step_batches"])

    def load_state_dict(self, state_dict: dict) -> None:
        from steadylm.data.position import resume_batch  # loaded only by a resume

        shape = self._shape()
        state = {"batches_done": 0, **state_dict}
        self.batches_done = resume_batch(state, shape["global_batch"], shape["step_batches"])[0]
