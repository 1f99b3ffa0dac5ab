"""`DataSource`: what startup, doctor and the stability suspects may ask of any `data:` DataModule.

A data source is one file: a LightningDataModule named by `data._target_` with these members; nothing outside it
reads its config keys, so a new source needs no edit elsewhere. `vocab_size` fills a null `model.vocab_size`,
`tokenizer_name` a null `data.tokenizer`; `bytes_per_token` (val bits per byte) and `n_train_windows` (doctor;
a stream) may be `None`; `window_ids(batch_idx)` (this rank's windows, `[]` if unknown) and `window_location(window)`
(`{shard, shard_path, start, end}`, `{}` if unknown) feed spike suspects; `state_dict()` / `load_state_dict()` are
exact resume (in every checkpoint). `setup("fit")` runs before anything else is built, so a bad source refuses with
one line up front; a DataModule lacking a member is refused at startup naming it (`missing_members`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class DataSource(Protocol):
    @property
    def vocab_size(self) -> int: ...
    @property
    def tokenizer_name(self) -> str: ...
    @property
    def bytes_per_token(self) -> float | None: ...
    @property
    def n_train_windows(self) -> int | None: ...
    def window_ids(self, batch_idx: int) -> list[int]: ...
    def window_location(self, window: int) -> dict: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state_dict: dict) -> None: ...
    def setup(self, stage: str | None = None) -> None: ...


MEMBERS = tuple(name for name in vars(DataSource) if not name.startswith("_"))


def missing_members(datamodule) -> list[str]:
    """The `DataSource` members `datamodule`'s class lacks (looked up on the class: no property is evaluated)."""
    return [name for name in MEMBERS if not hasattr(type(datamodule), name)]
