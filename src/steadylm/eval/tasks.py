"""Multiple-choice task files: each item is a context, its candidate completions and the index of the right one.

Two formats, told apart by their fields, one JSON object a line (`.jsonl`):

- HellaSwag as it ships (`hellaswag_val.jsonl`: `ctx_a`, `ctx_b`, `activity_label`, `endings`, `label`; or just
  `ctx`), turned into a query and choices exactly as lm-eval's `hellaswag` task does, so the numbers compare;
- generic: `{"context": str, "choices": [str, ...], "label": int}`.

A task is `PATH` (named after the file) or `NAME=PATH`. A bad file is one `SteadyError` naming it and the line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from steadylm.errors import SteadyError


@dataclass(frozen=True)
class Item:
    context: str
    choices: tuple[str, ...]
    label: int


@dataclass(frozen=True)
class Task:
    name: str
    path: Path
    items: tuple[Item, ...]


def hellaswag_text(text: str) -> str:
    """lm-eval's HellaSwag clean-up: WikiHow's `[title]` marks become sentence breaks, other brackets go."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def parse_item(row: dict) -> Item:
    if "endings" in row:
        ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize() if "ctx_a" in row else row["ctx"]
        query = f"{row['activity_label']}: {ctx}" if "activity_label" in row else ctx
        return Item(hellaswag_text(query), tuple(hellaswag_text(e) for e in row["endings"]), int(row["label"]))
    return Item(str(row["context"]), tuple(str(c) for c in row["choices"]), int(row["label"]))


def load_task(spec: str, limit: int | None = None) -> Task:
    """`PATH` or `NAME=PATH` -> a Task with its first `limit` items (None: all)."""
    name, _, path = spec.rpartition("=")
    path = Path(path).expanduser()
    name = name or path.name.split(".")[0]
    if not path.is_file():
        raise SteadyError(f"eval task file {path} does not exist (fetch one: python -m steadylm.eval.fetch hellaswag)")
    items = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(items) >= limit:
                break
            if not line.strip():
                continue
            try:
                item = parse_item(json.loads(line))
            except (ValueError, KeyError, TypeError, AttributeError) as err:
                raise SteadyError(
                    f"{path}:{n}: not a multiple-choice item ({type(err).__name__}: {err}); expected HellaSwag's "
                    'fields (ctx/endings/label) or {"context", "choices", "label"}'
                ) from None
            if not 0 <= item.label < len(item.choices):
                raise SteadyError(
                    f"{path}:{n}: label {item.label} is not an index into its {len(item.choices)} choices"
                )
            items.append(item)
    if not items:
        raise SteadyError(f"eval task file {path} has no items")
    return Task(name, path, tuple(items))
