"""`ShardDataModule`: the prepared shards in `data.dir` as Lightning train/val dataloaders.

Every shard is checked against the model config before training (vocabulary, tokenizer, context length): a
mismatch is one `DataError` naming the shard and the key, never a CUDA index error. Batches come from
`EpochBatchSampler`: exact epochs across ranks, static shapes, resumable. Each loader has its own
`torch.Generator`, so validation never draws from the global one (checkpointing.RNGState).
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from steadylm.compat import batches_processed
from steadylm.data.dataset import TokenWindows
from steadylm.data.sampler import EpochBatchSampler
from steadylm.data.shards import ShardInfo, read_shard_info, shard_files
from steadylm.errors import DataError


def _same_tokenizer(recorded: str, configured) -> bool:
    """Shards record the `data.tokenizer` spec that made them; a path may be spelled differently."""
    if recorded == str(configured):
        return True
    a, b = Path(recorded).expanduser(), Path(str(configured)).expanduser()
    return a.suffix == ".json" and a.exists() and b.exists() and a.resolve() == b.resolve()


class ShardDataModule(L.LightningDataModule):
    """The shard `DataSource` (data/source.py), answered from the shards' attributes. `input` .. `on_bad_record`
    are prepare's keys and `global_batch_tokens` startup's, accepted so one `data:` config says it all."""

    def __init__(
        self,
        dir,
        batch_size: int = 8,
        num_workers: int = 0,
        context_length: int = 256,
        model_vocab_size: int | None = None,
        tokenizer: str | None = "bytes",
        input=None,
        val_fraction: float = 0.01,
        text_field: str = "text",
        vocab_size: int | None = None,
        num_proc: int | None = None,
        on_bad_record: str = "error",
        global_batch_tokens: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        pin_memory: bool = False,
    ):
        super().__init__()
        self.dir = Path(dir).expanduser()
        self.batch_size, self.num_workers, self.context_length = int(batch_size), int(num_workers), int(context_length)
        self.model_vocab_size = None if model_vocab_size is None else int(model_vocab_size)
        self.tokenizer, self.seed = tokenizer, int(seed)
        self.shuffle, self.drop_last, self.pin_memory = bool(shuffle), bool(drop_last), bool(pin_memory)
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None
        self.infos: dict[str, list[ShardInfo]] = {}
        self._train_sampler: EpochBatchSampler | None = None
        self._pending_state: dict | None = None

    def _validate(self, infos: list[ShardInfo]) -> None:
        # read_shard_info refused a max_token_id >= its shard's vocab_size: vocab_size <= V covers every id
        first, V = infos[0], self.model_vocab_size
        for info in infos:
            if V is not None and info.vocab_size > V:
                raise DataError(
                    f"{info.path}: shard vocab_size {info.vocab_size} exceeds model.vocab_size "
                    f"{V}; set model.vocab_size >= {info.vocab_size}"
                )
            if self.tokenizer is not None and not _same_tokenizer(info.tokenizer, self.tokenizer):
                raise DataError(
                    f"{info.path}: written by tokenizer {info.tokenizer!r} but data.tokenizer is "
                    f"{self.tokenizer!r}; set data.tokenizer={info.tokenizer} or re-run prepare"
                )
            if (info.vocab_size, info.eos_id, info.tokenizer) != (first.vocab_size, first.eos_id, first.tokenizer):
                raise DataError(
                    f"{info.path}: tokenizer {info.tokenizer!r} (vocab {info.vocab_size}, eos {info.eos_id}) differs "
                    f"from {first.path.name} ({first.tokenizer!r}, {first.vocab_size}, {first.eos_id}); "
                    "re-run prepare so all shards share one tokenizer"
                )

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        infos = {split: [read_shard_info(p) for p in shard_files(self.dir, split)] for split in ("train", "val")}
        self._validate(infos["train"] + infos["val"])
        for split, inf in infos.items():
            if all(i.n_tokens < self.context_length + 1 for i in inf):
                longest = max(inf, key=lambda i: i.n_tokens)
                raise DataError(
                    f"{longest.path}: the longest {split} shard has {longest.n_tokens} tokens, fewer than "
                    f"model.context_length + 1 = {self.context_length + 1}; lower model.context_length or prepare "
                    "more data" + (" (or a larger data.val_fraction)" if split == "val" else "")
                )
        self.infos = infos
        self.train_set, self.val_set = (
            TokenWindows(
                [i.path for i in infos[s]], self.context_length, infos=infos[s], model_vocab_size=self.model_vocab_size
            )
            for s in ("train", "val")
        )
        if self.drop_last and len(self.train_set) < self.batch_size * self._world()[1]:
            raise DataError(
                f"{self.dir}: {len(self.train_set)} train windows are fewer than one global batch ({self.batch_size}"
                f" x {self._world()[1]} ranks) with drop_last=True; lower data.batch_size or set drop_last=False"
            )

    def _world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return (0, 1) if trainer is None else (int(trainer.global_rank), int(trainer.world_size))

    def _loader(self, dataset: TokenWindows, train: bool) -> DataLoader:
        rank, world = self._world()
        order = {"shuffle": self.shuffle, "drop_last": self.drop_last} if train else {"shuffle": False}
        sampler = EpochBatchSampler(len(dataset), self.batch_size, rank=rank, world_size=world, seed=self.seed, **order)
        if train:
            self._train_sampler = sampler
            if self._pending_state is not None:
                sampler.load_state_dict(self._pending_state)
                self._pending_state = None
        loader = DataLoader
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Several ranks: a bad window on one stops all of them with its one-line error (loaded only then).
            from steadylm.data.consensus import ConsensusLoader as loader
        return loader(
            dataset,
            batch_sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return self._loader(self.train_set, train=True)

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return self._loader(self.val_set, train=False)

    def _infos(self, split: str) -> list[ShardInfo]:
        self.setup(None)
        return self.infos[split]

    vocab_size = property(lambda self: self._infos("train")[0].vocab_size)
    eos_id = property(lambda self: self._infos("train")[0].eos_id)
    tokenizer_name = property(lambda self: self._infos("train")[0].tokenizer)

    @property
    def n_train_windows(self) -> int:
        self.setup(None)
        return len(self.train_set)

    n_train_tokens = property(lambda self: sum(i.n_tokens for i in self._infos("train")))
    val_n_tokens = property(lambda self: sum(i.n_tokens for i in self._infos("val")))  # end-of-text ids included

    @property
    def val_n_bytes(self) -> int | None:
        """UTF-8 bytes of the text behind the val shards' tokens; None if any val shard is format 1."""
        sizes = [i.n_bytes for i in self._infos("val")]
        return None if None in sizes else int(sum(sizes))

    @property
    def bytes_per_token(self) -> float | None:
        """UTF-8 bytes per val token (shard format 2 records the bytes); None when a shard does not say."""
        n_bytes, n_tokens = self.val_n_bytes, self.val_n_tokens
        return n_bytes / n_tokens if n_bytes and n_tokens else None

    def window_location(self, window: int) -> dict:
        """{shard, shard_path, start, end} of a train window id; {} for padding (-1)."""
        if window < 0:
            return {}
        self.setup(None)
        shard_no, start = self.train_set.locate(window)
        path = self.train_set.paths[shard_no]
        return {"shard": path.name, "shard_path": str(path), "start": start, "end": start + self.context_length + 1}

    def window_ids(self, batch_idx: int) -> list[int]:
        """This rank's window ids at `batch_idx` of the current epoch, one per row (-1: padding)."""
        return [] if self._train_sampler is None else self._train_sampler.batch_windows(batch_idx)

    def state_dict(self) -> dict:
        """`{"train_sampler": {"epoch", "batches_done"}}` for an exact mid-epoch resume; while fitting, the batches
        done are the Trainer's (the sampler runs ahead by prefetch)."""
        if self._train_sampler is None:
            return {"train_sampler": dict(self._pending_state)} if self._pending_state else {}
        trainer = getattr(self, "trainer", None)
        if trainer is not None and getattr(trainer, "training", False):
            return {"train_sampler": {"epoch": int(trainer.current_epoch), "batches_done": batches_processed(trainer)}}
        return {"train_sampler": self._train_sampler.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if not (state := state_dict.get("train_sampler")):
            return
        if self._train_sampler is not None:
            self._train_sampler.load_state_dict(state)
        else:
            self._pending_state = dict(state)
