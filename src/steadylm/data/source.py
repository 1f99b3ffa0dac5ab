"""`DataSource`: what startup, doctor and the stability suspects may ask of any `data:` DataModule.

Only the DataModule reads its config keys, so a new source is one file. `bytes_per_token` and `n_train_windows` may
be `None`, `window_ids` `[]` and `window_location` `{}` when unknown; `setup("fit")` runs before anything else is
built, so a bad source refuses with one line up front. Two members are optional: `document_separator`, the id
attention and positions restart after under `data.pack=doc` (or None, `check_pack`); and, for a source whose
position is counted in batches, `align_resume(checkpoint)`, which the module calls first on a resume to recount it
for this run's number of ranks and accumulation (data/position.py).
"""

from __future__ import annotations

from typing import Protocol

from steadylm.errors import ConfigError


class DataSource(Protocol):
    batch_size: int  # sequences per micro-batch on each rank (the memory plan, `data.global_batch_tokens`)

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


def missing_members(datamodule) -> list[str]:
    """The `DataSource` members `datamodule` lacks (methods and properties looked up on the class: none is evaluated;
    attributes on the instance too)."""
    methods = [name for name in vars(DataSource) if name[0] != "_" and not hasattr(type(datamodule), name)]
    return [n for n in DataSource.__annotations__ if not hasattr(datamodule, n)] + methods


def check_pack(pack: str) -> str:
    """`data.pack`: none (windows as they come) or doc (documents masked apart at the end-of-text id)."""
    if pack not in ("none", "doc"):
        raise ConfigError(f"data.pack={pack!r} is not allowed; it must be none or doc (documents masked apart)")
    return pack
