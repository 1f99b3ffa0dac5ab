"""`DataSource`: what startup, doctor and the stability suspects may ask of any `data:` DataModule.

A data source is one file: a LightningDataModule named by `data._target_` that has these members. Nothing
outside the DataModule reads its config keys (no `cfg.data.dir`), so a new source needs no edit elsewhere.

| member | used by | unknown |
| --- | --- | --- |
| `vocab_size` | startup fills a null `model.vocab_size` from it (resolve.py) | - (required) |
| `tokenizer_name` | a null `data.tokenizer`; the run's recorded tokenizer | - (required) |
| `bytes_per_token` | val bits per byte | `None` |
| `n_train_windows` | doctor's epochs-of-data row | `None` (a stream) |
| `window_ids(batch_idx)` | spike suspects: which windows this rank's batch held | `[]` |
| `window_location(window)` | suspects: `{shard, shard_path, start, end}` of a window | `{}` |
| `state_dict()` / `load_state_dict()` | exact resume (Lightning saves it in every checkpoint) | - (required) |

`setup("fit")` runs before anything else is built, so a bad source refuses with one line up front; a DataModule
that lacks a member is refused at startup naming it (`missing_members`), rather than losing resume or suspects.
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
