"""`ShardDataModule`: the prepared shards in `data.dir` as Lightning train/val dataloaders.

It validates every shard against the model config before training starts (vocabulary,
tokenizer, context length) and refuses with one `DataError` naming the shard file and the
config key, so a mismatch never surfaces as a CUDA index error or a traceback through
Lightning. Batching is done by `EpochBatchSampler` (the Trainer runs with
`use_distributed_sampler=False`): exact epochs across ranks, static shapes, resumable.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch.distributed as dist
from torch.utils.data import DataLoader

from steadylm.compat import batches_processed
from steadylm.data.consensus import ConsensusLoader
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
    """The shard `DataSource` (data/source.py): every member answered from the shards' attributes."""

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
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.context_length = int(context_length)
        self.model_vocab_size = None if model_vocab_size is None else int(model_vocab_size)
        self.tokenizer = tokenizer
        # Read by prepare only; kept so one `data:` config describes the data end to end.
        self.input, self.val_fraction, self.text_field = input, val_fraction, text_field
        self.bpe_vocab_size, self.num_proc, self.on_bad_record = vocab_size, num_proc, on_bad_record
        self.global_batch_tokens = global_batch_tokens
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.drop_last = bool(drop_last)
        self.pin_memory = bool(pin_memory)
        self.train_set: TokenWindows | None = None
        self.val_set: TokenWindows | None = None
        self.infos: dict[str, list[ShardInfo]] = {}
        self._train_sampler: EpochBatchSampler | None = None
        self._pending_state: dict | None = None

    # --- discovery and validation ---------------------------------------------------------

    def _validate(self, infos: list[ShardInfo]) -> None:
        first = infos[0]
        for info in infos:
            if self.model_vocab_size is not None and info.vocab_size > self.model_vocab_size:
                raise DataError(
                    f"{info.path}: shard vocab_size {info.vocab_size} exceeds model.vocab_size "
                    f"{self.model_vocab_size}; set model.vocab_size >= {info.vocab_size}"
                )
            if self.model_vocab_size is not None and info.max_token_id >= self.model_vocab_size:
                raise DataError(
                    f"{info.path}: holds token id {info.max_token_id} >= model.vocab_size "
                    f"{self.model_vocab_size}; set model.vocab_size >= {info.vocab_size}"
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

    def _check_windows(self, split: str, infos: list[ShardInfo]) -> None:
        if any(i.n_tokens >= self.context_length + 1 for i in infos):
            return
        longest = max(infos, key=lambda i: i.n_tokens)
        raise DataError(
            f"{longest.path}: the longest {split} shard has {longest.n_tokens} tokens, fewer than "
            f"model.context_length + 1 = {self.context_length + 1}; lower model.context_length or prepare more data"
            + (" (or a larger data.val_fraction)" if split == "val" else "")
        )

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        paths = {split: shard_files(self.dir, split) for split in ("train", "val")}
        infos = {split: [read_shard_info(p) for p in ps] for split, ps in paths.items()}
        self._validate(infos["train"] + infos["val"])
        for split, inf in infos.items():
            self._check_windows(split, inf)
        self.infos = infos
        self.train_set = TokenWindows(
            paths["train"], self.context_length, infos=infos["train"], model_vocab_size=self.model_vocab_size
        )
        self.val_set = TokenWindows(
            paths["val"], self.context_length, infos=infos["val"], model_vocab_size=self.model_vocab_size
        )
        if self.drop_last and len(self.train_set) < self.batch_size * self._world()[1]:
            raise DataError(
                f"{self.dir}: {len(self.train_set)} train windows are fewer than one global batch "
                f"({self.batch_size} x {self._world()[1]} ranks) with drop_last=True; lower data.batch_size or set drop_last=False"
            )

    # --- loaders --------------------------------------------------------------------------

    def _world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        if trainer is None:
            return 0, 1
        return int(trainer.global_rank), int(trainer.world_size)

    def _loader(self, dataset: TokenWindows, sampler: EpochBatchSampler) -> DataLoader:
        # Several ranks: a bad window on one of them stops all of them with its one-line error (consensus.py).
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        return (ConsensusLoader if distributed else DataLoader)(
            dataset,
            batch_sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        rank, world = self._world()
        self._train_sampler = EpochBatchSampler(
            len(self.train_set),
            self.batch_size,
            rank=rank,
            world_size=world,
            seed=self.seed,
            shuffle=self.shuffle,
            drop_last=self.drop_last,
        )
        if self._pending_state is not None:
            self._train_sampler.load_state_dict(self._pending_state)
            self._pending_state = None
        return self._loader(self.train_set, self._train_sampler)

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        rank, world = self._world()
        sampler = EpochBatchSampler(
            len(self.val_set),
            self.batch_size,
            rank=rank,
            world_size=world,
            seed=self.seed,
            shuffle=False,
            drop_last=False,
        )
        return self._loader(self.val_set, sampler)

    # --- facts from the shards ------------------------------------------------------------

    def _first(self) -> ShardInfo:
        self.setup(None)
        return self.infos["train"][0]

    @property
    def vocab_size(self) -> int:
        return self._first().vocab_size

    @property
    def eos_id(self) -> int:
        return self._first().eos_id

    @property
    def tokenizer_name(self) -> str:
        return self._first().tokenizer

    @property
    def n_train_windows(self) -> int:
        self.setup(None)
        return len(self.train_set)

    @property
    def n_train_tokens(self) -> int:
        self.setup(None)
        return sum(i.n_tokens for i in self.infos["train"])

    @property
    def val_n_tokens(self) -> int:
        """Tokens in the val shards (end-of-text separators included)."""
        self.setup(None)
        return sum(i.n_tokens for i in self.infos["val"])

    @property
    def val_n_bytes(self) -> int | None:
        """UTF-8 bytes of the text behind the val shards' tokens; None if any val shard is format 1."""
        self.setup(None)
        sizes = [i.n_bytes for i in self.infos["val"]]
        return None if any(b is None for b in sizes) else int(sum(sizes))

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
        shard_no, offset = self.train_set.locate(window)
        path = self.train_set.paths[shard_no]
        return {
            "shard": Path(path).name,
            "shard_path": str(path),
            "start": int(offset),
            "end": int(offset) + self.context_length + 1,
        }

    def window_ids(self, batch_idx: int) -> list[int]:
        """This rank's window ids at `batch_idx` of the current epoch, one per row (-1: padding)."""
        if self._train_sampler is None:
            return []
        return [int(i) for i in self._train_sampler.batch_windows(batch_idx)]

    # --- resume ---------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """`{"train_sampler": {"epoch", "batches_done"}}` for an exact mid-epoch resume.

        The sampler itself runs ahead of training (Lightning fetches one batch early, workers
        prefetch more), so while a Trainer is fitting, the count of batches the loop has actually
        processed is taken from the Trainer instead.
        """
        if self._train_sampler is None:
            return {"train_sampler": dict(self._pending_state)} if self._pending_state else {}
        state = self._train_sampler.state_dict()
        trainer = getattr(self, "trainer", None)
        if trainer is not None and getattr(trainer, "training", False):
            state = {
                "epoch": int(trainer.current_epoch),
                "batches_done": batches_processed(trainer),
            }
        return {"train_sampler": state}

    def load_state_dict(self, state_dict: dict) -> None:
        state = state_dict.get("train_sampler")
        if not state:
            return
        if self._train_sampler is not None:
            self._train_sampler.load_state_dict(state)
        else:
            self._pending_state = dict(state)
