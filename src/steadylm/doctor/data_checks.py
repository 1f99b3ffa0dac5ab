"""Data rows: every shard opens with consistent attributes, and the DataModule accepts its data for this model.

Both reuse what training runs (`read_shard_info`, the DataModule's `setup` and first batch), so data doctor
passes is data training accepts. The DataModule row asks only the `DataSource` members (data/source.py), so
any `data:` source is checked; the shard row applies to a source that reads shards from `data.dir`.
Returns the DataModule's first batch for the model checks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from steadylm.data.shards import read_shard_info
from steadylm.derived import data_source
from steadylm.devices import devices_of
from steadylm.doctor.check import OK, WARN, Check, from_error, guarded

SPLITS = ("train", "val")


def check_shards(cfg: DictConfig, deep: bool) -> list[Check]:
    """One row per unreadable shard (all of them, not just the first), else one summary row.

    `--deep` reads every token id (with a progress bar) and refuses the first one outside the shard's
    vocabulary, naming the file, token offset and id as training does when it reaches that window (the
    DataModule row already refuses a shard vocabulary larger than model.vocab_size).
    """
    if sources := cfg.data.get("sources"):  # data.sources: a row per source
        return [row for name, spec in sources.items() for row in shard_rows(Path(spec.dir), deep, f" ({name})")]
    if cfg.data.get("dir") is None:
        return []  # a source without shards (e.g. data=hf_stream): its own checks run in its setup
    return shard_rows(Path(cfg.data.dir), deep)


def shard_rows(folder: Path, deep: bool, source: str = "") -> list[Check]:
    folder = folder.expanduser()
    paths = sorted(p for split in SPLITS for p in folder.glob(f"{split}-*.h5"))
    if not paths:
        return []  # the DataModule row names the missing folder or split and how to prepare it
    rows, infos = [], []
    for path in paths:
        try:
            infos.append(read_shard_info(path, deep=deep, progress=deep))
        except Exception as err:
            rows.append(from_error(f"data: shard {path.name}{source}", err))
    if rows:
        return rows
    how = "every token rescanned" if deep else "attrs only; --deep rescans tokens"
    n = sum(i.n_tokens for i in infos)
    versions = "/".join(str(v) for v in sorted({i.format_version for i in infos}))
    return [
        Check(
            f"data: shards{source}",
            OK,
            f"{len(infos)} shards in {folder} open, format {versions}, {n:,} tokens, vocab "
            f"{infos[0].vocab_size}, max id {max(i.max_token_id for i in infos)} ({how})",
        )
    ]


def check_datamodule(cfg: DictConfig) -> tuple[list[Check], tuple[torch.Tensor, torch.Tensor] | None]:
    """Vocab vs model, one tokenizer, windows of context_length + 1, a val split; then run length."""
    dm = data_source(cfg)
    V, n_windows = cfg.model.vocab_size, dm.n_train_windows
    x, y = next(iter(dm.train_dataloader()))
    windows = f"; {n_windows:,} train windows of {x.shape[1] + 1} tokens" if n_windows else ""
    rows = [
        Check(
            "data: fits the model",
            OK,
            f"data vocab {dm.vocab_size} <= model.vocab_size {V}, tokenizer {dm.tokenizer_name}{windows}",
        )
    ]
    if n_windows:  # a stream does not know its length
        t = cfg.trainer
        ranks = devices_of(cfg).world_size
        per_step = int(dm.batch_size) * int(t.get("accumulate_grad_batches", 1)) * ranks
        epochs = int(t.max_steps) * per_step / n_windows
        evidence = f"{t.max_steps} steps x {per_step} windows ({ranks} rank(s)) = {epochs:.2f} epochs of {n_windows:,}"
        if epochs > 20:
            rows.append(
                Check(
                    "data: enough tokens",
                    WARN,
                    f"{evidence}: each window is seen {epochs:.0f} times (overfits)",
                    "prepare more data or lower trainer.max_steps",
                )
            )
        else:
            rows.append(Check("data: enough tokens", OK, evidence))
        if getattr(dm, "sources", None):  # data.sources: each one's share and epochs, as training logs them
            rows.append(Check("data: sources", OK, "; ".join(dm.mixture_lines(int(t.max_steps) * per_step))))
    return rows, (x[:4], y[:4])


def data_checks(cfg: DictConfig, deep: bool) -> tuple[list[Check], tuple[torch.Tensor, torch.Tensor] | None]:
    rows = guarded("data: shards", lambda: check_shards(cfg, deep))
    batch = None

    def run() -> list[Check]:
        nonlocal batch
        dm_rows, batch = check_datamodule(cfg)
        return dm_rows

    return rows + guarded("data: fits the model", run), batch
