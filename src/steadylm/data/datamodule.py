"""`ShardDataModule`: the prepared shards in `data.dir` as Lightning train/val dataloaders, every shard checked
against the model config (vocabulary, tokenizer, context length) before training."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from steadylm.compat import batches_processed
from steadylm.data.dataset import TokenWindows
from steadylm.data.mixture import BLOCK, MixtureBatchSampler, MixtureOrder, check_sources, no_val_window
from steadylm.data.sampler import EpochBatchSampler
from steadylm.data.shards import ShardInfo, read_shard_info
from steadylm.data.source import check_pack
from steadylm.data.tokenizer import same_tokenizer
from steadylm.errors import DataError
from steadylm.model.config import GPTConfig

log = logging.getLogger("steadylm")


def _bytes_per_token(val: list[ShardInfo]) -> float | None:
    n_bytes = [i.n_bytes for i in val]
    return None if None in n_bytes or not sum(n_bytes) else sum(n_bytes) / sum(i.n_tokens for i in val)


class ShardDataModule(L.LightningDataModule):
    """The shard `DataSource` (data/source.py), answered from the shards' attributes. `input` .. `on_bad_record`
    are prepare's keys and `global_batch_tokens` startup's, accepted so one `data:` config says it all.

    `sources` ({name: {dir, weight}}) trains several prepared folders at those token shares instead of `dir`
    (data/mixture.py): one window id space over every source's shards, a val loader per source."""

    def __init__(
        self,
        dir,
        batch_size: int = 16,
        num_workers: int = 0,
        context_length: int = GPTConfig.context_length,  # the default model's: a window is one of its sequences
        model_vocab_size: int | None = None,
        tokenizer: str | None = None,  # None: the one the shards record
        input=None,
        val_fraction: float = 0.01,
        text_field: str = "text",
        vocab_size: int | None = None,
        num_proc: int | None = None,
        on_bad_record: str = "error",
        global_batch_tokens: int | None = None,
        seed: int = 1337,  # train.yaml's `seed`, which a run passes
        shuffle: bool = True,
        drop_last: bool = False,
        pin_memory: bool = False,
        align: str = "none",
        pack: str = "none",
        sources: dict | None = None,
        val_windows: int | None = 320,
    ):
        super().__init__()
        self.pack = check_pack(pack)
        self.dir = Path(dir).expanduser()
        self.sources = check_sources(sources)  # {name: (folder, weight)}, or None: `dir` alone
        self.batch_size, self.num_workers, self.context_length = int(batch_size), int(num_workers), int(context_length)
        self.model_vocab_size = None if model_vocab_size is None else int(model_vocab_size)
        self.tokenizer, self.seed, self.align = tokenizer, int(seed), align
        self.shuffle, self.drop_last, self.pin_memory = bool(shuffle), bool(drop_last), bool(pin_memory)
        self.val_windows = None if val_windows is None else int(val_windows)
        self.train_set = self.val_set = self._train_sampler = self._pending_state = None
        self.infos: dict[str, list[ShardInfo]] = {}

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        folders = {name: d for name, (d, _) in self.sources.items()} if self.sources else {None: self.dir}
        infos, self.shards_of = {"train": [], "val": []}, {}  # shards_of[name][split]: that source's shard infos
        for name, folder in folders.items():
            key = "data.dir" if name is None else f"data.sources.{name}.dir"
            hint = f"; run `make data` or `python -m steadylm.data.prepare data.dir={folder}`"
            if not folder.is_dir():
                raise DataError(f"{folder}: {key} does not exist" + hint)
            self.shards_of[name] = {}
            for split in ("train", "val"):
                if not (files := sorted(folder.glob(f"{split}-*.h5"))):
                    raise DataError(f"{folder}: no {split} shards ({split}-*.h5) found" + hint)
                self.shards_of[name][split] = [read_shard_info(p) for p in files]
                infos[split] += self.shards_of[name][split]
        # read_shard_info refused a max_token_id >= its shard's vocab_size: vocab_size <= V covers every id
        first, V = infos["train"][0], self.model_vocab_size
        for info in infos["train"] + infos["val"]:
            if V is not None and info.vocab_size > V:
                raise DataError(
                    f"{info.path}: shard vocab_size {info.vocab_size} exceeds model.vocab_size "
                    f"{V}; set model.vocab_size >= {info.vocab_size} (with model.init_from: prepare the data with "
                    "the model's tokenizer)"
                )
            if self.tokenizer is not None and not same_tokenizer(info.tokenizer, self.tokenizer):
                raise DataError(
                    f"{info.path}: written by tokenizer {info.tokenizer!r} but data.tokenizer is "
                    f"{self.tokenizer!r}; set data.tokenizer={info.tokenizer} or re-run prepare"
                )
            if (info.vocab_size, info.eos_id, info.tokenizer) != (first.vocab_size, first.eos_id, first.tokenizer):
                raise DataError(
                    f"{info.path}: tokenizer {info.tokenizer!r} (vocab {info.vocab_size}, eos {info.eos_id}) differs "
                    f"from {first.path} ({first.tokenizer!r}, {first.vocab_size}, {first.eos_id}); "
                    + (
                        "prepare every source with one tokenizer"
                        if self.sources
                        else "re-run prepare so all shards share one tokenizer"
                    )
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
        if self.sources:
            self._mixture_sets(V)

    def _world(self) -> tuple[int, int]:
        trainer = getattr(self, "trainer", None)
        return (0, 1) if trainer is None else (int(trainer.global_rank), int(trainer.world_size))

    def _mixture_sets(self, V) -> None:
        """The train windows' order over the sources (sizes from the joint id space), and one val set per source."""
        ends = np.cumsum([len(self.shards_of[name]["train"]) for name in self.sources])
        sizes = np.diff(self.train_set.starts[np.concatenate([[0], ends])])
        for name, size in zip(self.sources, sizes.tolist()):
            if not size:
                shard = self.shards_of[name]["train"][0].path
                raise DataError(f"{shard}: source {name!r} has no train window of model.context_length + 1 tokens")
        weights = [w for _, w in self.sources.values()]
        self.order = MixtureOrder(sizes.tolist(), weights, self.seed, self.shuffle, names=list(self.sources))
        self.val_sets = {
            name: TokenWindows([i.path for i in s["val"]], self.context_length, infos=s["val"], model_vocab_size=V)
            for name, s in self.shards_of.items()
        }
        for name, val in self.val_sets.items():  # an empty one would read 0.0 and pull val/loss down by its weight
            if not len(val):
                raise DataError(no_val_window(name, self.shards_of[name]["val"], self.context_length))

    def _sampler(self, dataset: TokenWindows, train: bool) -> EpochBatchSampler:
        """Train: whole optimizer steps of the Trainer's accumulation, so step k's windows follow from the seed;
        with `sources`, the mixture's stream (data/mixture.py). Val: the split's first `val_windows` windows in order,
        split across ranks, so any machine and micro-batch size validates the same windows."""
        rank, world = self._world()
        accumulate = int(self.trainer.accumulate_grad_batches) if train and self.trainer is not None else 1
        order = {"shuffle": self.shuffle, "drop_last": self.drop_last, "step_batches": accumulate}
        order = order if train else {"shuffle": False}
        kw = {"rank": rank, "world_size": world, "seed": self.seed, **order}
        if train and self.sources:
            return MixtureBatchSampler(self.order, self.batch_size, **kw)
        n = len(dataset) if train or self.val_windows is None else min(len(dataset), self.val_windows)
        return EpochBatchSampler(n, self.batch_size, **kw)  # val: its first windows, whatever the ranks and batch

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
        loader = self._loader(self.train_set, train=True)
        if self.sources and (trainer := getattr(self, "trainer", None)) is not None and trainer.is_global_zero:
            windows = trainer.max_steps * trainer.accumulate_grad_batches * self.batch_size * trainer.world_size
            for line in self.mixture_lines(windows):
                log.info(line)
        return loader

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """One loader, or with `sources` one per source (`val/loss/<name>`), in `val_sources` order."""
        self.setup("validate")
        if self.sources:
            return [self._loader(ds, train=False) for ds in self.val_sets.values()]
        return self._loader(self.val_set, train=False)

    def mixture_lines(self, windows: int) -> list[str]:
        """Each source's share of the tokens and the epochs of it a run of `windows` windows reads."""
        T, lines = self.context_length, []
        for s, name in enumerate(self.sources):
            share, size = self.order.quota[s] / BLOCK, int(self.order.sizes[s])
            lines.append(
                f"data.sources.{name}: {share:.1%} of the tokens, {size:,} train windows ({size * T:,} tokens); "
                f"this run reads {share * windows / size:.2f} epochs of it"
            )
        return lines

    @property
    def val_sources(self) -> list[dict] | None:
        """[{name, weight, bytes_per_token}] of each source's val loader, in order; None for one `dir`."""
        if not self.sources:
            return None
        self.setup(None)
        return [
            {
                "name": name,
                "weight": float(self.order.quota[s]) / BLOCK,
                "bytes_per_token": _bytes_per_token(self.shards_of[name]["val"]),
            }
            for s, name in enumerate(self.sources)
        ]

    def _infos(self, split: str) -> list[ShardInfo]:
        self.setup(None)
        return self.infos[split]

    vocab_size = property(lambda self: self._infos("train")[0].vocab_size)
    # data.pack=doc: the shards' end-of-text id, where attention and positions restart (None: windows as they come)
    document_separator = property(lambda self: self._infos("train")[0].eos_id if self.pack == "doc" else None)
    tokenizer_name = property(lambda self: self._infos("train")[0].tokenizer)
    n_train_windows = property(lambda self: self.setup(None) or len(self.train_set))

    @property
    def bytes_per_token(self) -> float | None:
        """UTF-8 bytes of the val shards' text per token (end-of-text ids included); None if one is format 1."""
        return _bytes_per_token(self._infos("val"))

    def window_location(self, window: int) -> dict:
        if window < 0:
            return {}
        self.setup(None)
        s, start, targets = self.train_set.locate(window)
        path = self.train_set.paths[s]
        where = {"shard": path.name, "shard_path": str(path), "start": start, "end": start + targets + 1}
        if self.sources:  # a source's shards are a run of the joint list, in `sources` order
            ends = np.cumsum([len(self.shards_of[name]["train"]) for name in self.sources])
            where = {"source": list(self.sources)[int(np.searchsorted(ends, s, side="right"))], **where}
        return where

    def window_ids(self, batch_idx: int) -> list[int]:
        return [] if self._train_sampler is None else self._train_sampler.batch_windows(batch_idx)

    def state_dict(self) -> dict:
        """The sampler's position for an exact resume; while fitting, the Trainer's (the sampler runs ahead)."""
        if self._train_sampler is None:
            return {"train_sampler": dict(self._pending_state)} if self._pending_state else {}
        if (trainer := self.trainer) is not None and trainer.training:
            done = {"epoch": int(trainer.current_epoch), "batches_done": batches_processed(trainer)}
            return {"train_sampler": self._train_sampler.state_at(**done, step=int(trainer.global_step))}
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
