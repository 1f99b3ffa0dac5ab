"""`ShardDataModule`: the prepared shards in `data.dir` as Lightning train/val dataloaders, every shard checked
against the model config (vocabulary, tokenizer, context length) before training."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from steadylm.compat import batches_processed
from steadylm.data.dataset import TokenWindows
from steadylm.data.sampler import EpochBatchSampler
from steadylm.data.shards import ShardInfo, read_shard_info
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
        align: str = "none",
    ):
        super().__init__()
        self.dir = Path(dir).expanduser()
        self.batch_size, self.num_workers, self.context_length = int(batch_size), int(num_workers), int(context_length)
        self.model_vocab_size = None if model_vocab_size is None else int(model_vocab_size)
        self.tokenizer, self.seed, self.align = tokenizer, int(seed), align
        self.shuffle, self.drop_last, self.pin_memory = bool(shuffle), bool(drop_last), bool(pin_memory)
        self.train_set = self.val_set = self._train_sampler = self._pending_state = None
        self.infos: dict[str, list[ShardInfo]] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        hint = f"; run `make data` or `python -m steadylm.data.prepare data.dir={self.dir}`"
        if not self.dir.is_dir():
            raise DataError(f"{self.dir}: data.dir does not exist" + hint)
        infos = {}
        for split in ("train", "val"):
            if not (files := sorted(self.dir.glob(f"{split}-*.h5"))):
                raise DataError(f"{self.dir}: no {split} shards ({split}-*.h5) found" + hint)
            infos[split] = [read_shard_info(p) for p in files]
        # read_shard_info refused a max_token_id >= its shard's vocab_size: vocab_size <= V covers every id
        first, V = infos["train"][0], self.model_vocab_size
        for info in infos["train"] + infos["val"]:
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
        sets = {}
        for split, inf in infos.items():
            align = self.align if split == "train" else "none"  # val as it was: val/loss compares across it
            sets[split] = TokenWindows(
                [i.path for i in inf], self.context_length, infos=inf, model_vocab_size=V, align=align
            )
            if not len(sets[split]):  # no shard holds context_length + 1 tokens
                longest = max(inf, key=lambda i: i.n_tokens)
                raise DataError(
                    f"{longest.path}: the longest {split} shard has {longest.n_tokens} tokens, fewer than "
                    f"model.context_length + 1 = {self.context_length + 1}; lower model.context_length or prepare "
                    "more data" + (" (or a larger data.val_fraction)" if split == "val" else "")
                )
        self.infos, self.train_set, self.val_set = infos, sets["train"], sets["val"]
        if self.drop_last and len(self.train_set) < self.batch_size * (world := self._world()[1]):
            raise DataError(
                f"{self.dir}: {len(self.train_set)} train windows are fewer than one global batch ({self.batch_size}"
                f" x {world} ranks) with drop_last=True; lower data.batch_size or set drop_last=False"
            )

    def _world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return (0, 1) if trainer is None else (int(trainer.global_rank), int(trainer.world_size))

    def _sampler(self, dataset: TokenWindows, train: bool) -> EpochBatchSampler:
        """Train: whole optimizer steps of the Trainer's accumulation, so step k's windows follow from the seed."""
        rank, world = self._world()
        accumulate = int(self.trainer.accumulate_grad_batches) if train and self.trainer is not None else 1
        order = {"shuffle": self.shuffle, "drop_last": self.drop_last, "step_batches": accumulate}
        order = order if train else {"shuffle": False}
        return EpochBatchSampler(len(dataset), self.batch_size, rank=rank, world_size=world, seed=self.seed, **order)

    def _loader(self, dataset: TokenWindows, train: bool) -> DataLoader:
        sampler = self._sampler(dataset, train)
        if train:
            self._train_sampler = sampler
            if self._pending_state is not None:
                sampler.load_state_dict(self._pending_state)
                self._pending_state = None
        loader = DataLoader
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            # Several ranks: a bad window on one stops all of them with its one-line error (loaded only then).
            from steadylm.data.consensus import ConsensusLoader as loader
        workers = {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}
        gen = torch.Generator().manual_seed(self.seed)  # the loader's own: none draws from the global one
        return loader(dataset, batch_sampler=sampler, pin_memory=self.pin_memory, generator=gen, **workers)

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
    tokenizer_name = property(lambda self: self._infos("train")[0].tokenizer)
    n_train_windows = property(lambda self: self.setup(None) or len(self.train_set))

    @property
    def bytes_per_token(self) -> float | None:
        """UTF-8 bytes of the val shards' text per token (end-of-text ids included); None if one is format 1."""
        val = self._infos("val")
        n_bytes = [i.n_bytes for i in val]
        return None if None in n_bytes or not sum(n_bytes) else sum(n_bytes) / sum(i.n_tokens for i in val)

    def window_location(self, window: int) -> dict:
        if window < 0:
            return {}
        self.setup(None)
        s, start, targets = self.train_set.locate(window)
        path = self.train_set.paths[s]
        return {"shard": path.name, "shard_path": str(path), "start": start, "end": start + targets + 1}

    def window_ids(self, batch_idx: int) -> list[int]:
        return [] if self._train_sampler is None else self._train_sampler.batch_windows(batch_idx)

    def state_dict(self) -> dict:
        """The sampler's position for an exact resume; while fitting, the Trainer's (the sampler runs ahead)."""
        if self._train_sampler is None:
            return {"train_sampler": dict(self._pending_state)} if self._pending_state else {}
        if (trainer := self.trainer) is not None and trainer.training:
            done = {"epoch": int(trainer.current_epoch), "batches_done": batches_processed(trainer)}
            return {"train_sampler": {**done, **self._train_sampler.shape()}}
        return {"train_sampler": self._train_sampler.state_dict()}

    def align_resume(self, checkpoint: dict) -> None:
        """The checkpoint's batch counts in this run's shape (data/position.py), before Lightning loads them."""
        if state := (checkpoint.get(type(self).__qualname__) or {}).get("train_sampler"):
            from steadylm.data.position import align_resume  # loaded only by a resume

            self.setup("fit")
            sampler = self._sampler(self.train_set, train=True)
            align_resume(checkpoint, state, sampler.global_batch, sampler.step_batches)

    def load_state_dict(self, state_dict: dict) -> None:
        if (state := state_dict.get("train_sampler")) and self._train_sampler is not None:
            self._train_sampler.load_state_dict(state)
        elif state:
            self._pending_state = dict(state)
