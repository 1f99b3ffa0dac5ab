"""Tokenizers: text <-> token ids, identified by a short name stored in every shard.

The name (`bytes`, `gpt2`) is what shards record in their `tokenizer` attribute and what the
DataModule compares against the config, so a model is never trained on ids from a different
vocabulary. `bytes` works offline everywhere; `gpt2` needs `tiktoken` (and network once).
This module must never download anything on import.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Protocol

from steadylm.errors import SteadyError

TOKENIZER_FILE = "tokenizer.json"


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus an end-of-document id 256: lossless, no files, no network."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class TiktokenTokenizer:
    """GPT-2 BPE through `tiktoken` (imported lazily; its vocabulary file is fetched once)."""

    name = "gpt2"
    vocab_size = 50257
    eos_id = 50256

    def __init__(self) -> None:
        try:
            import tiktoken
        except ImportError as e:
            raise SteadyError(
                "tokenizer 'gpt2' needs the tiktoken package: run `pip install tiktoken` "
                "(it also needs network once to download the GPT-2 vocabulary), or use data.tokenizer=bytes"
            ) from e
        try:
            self._enc = tiktoken.get_encoding("gpt2")
        except Exception as e:  # network/cache failures surface as many exception types
            raise SteadyError(
                f"tokenizer 'gpt2': tiktoken could not load the GPT-2 vocabulary ({type(e).__name__}: {e}); "
                "it needs network once to download it (`pip install tiktoken` and retry online), "
                "or use data.tokenizer=bytes"
            ) from e

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids if int(i) != self.eos_id])

    def __repr__(self) -> str:
        return "TiktokenTokenizer('gpt2')"


_REGISTRY = {"bytes": ByteTokenizer, "gpt2": TiktokenTokenizer}


def get_tokenizer(name: str) -> Tokenizer:
    """Return a tokenizer by name (`bytes` or `gpt2`)."""
    try:
        cls = _REGISTRY[name]
    except (KeyError, TypeError):
        raise SteadyError(
            f"unknown tokenizer {name!r} (data.tokenizer): valid names are {', '.join(sorted(_REGISTRY))}"
        ) from None
    return cls()


def save_tokenizer(tok: Tokenizer, directory) -> Path:
    """Write `directory/tokenizer.json` describing `tok`; returns its path."""
    path = Path(directory) / TOKENIZER_FILE
    meta = {"name": tok.name, "vocab_size": int(tok.vocab_size), "eos_id": int(tok.eos_id)}
    tmp = path.with_suffix(".json.partial")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def load_tokenizer(dir_or_name) -> Tokenizer:
    """Load from a directory holding `tokenizer.json` (or that file itself), or by name."""
    p = Path(dir_or_name)
    if p.is_dir():
        p = p / TOKENIZER_FILE
    if p.name == TOKENIZER_FILE or p.suffix == ".json":
        if not p.is_file():
            raise SteadyError(f"{p}: tokenizer file not found; run `python -m steadylm.data.prepare` to create it")
        try:
            meta = json.loads(p.read_text())
            name = meta["name"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise SteadyError(f"{p}: not a valid tokenizer.json ({e}); re-run prepare to rewrite it") from None
        tok = get_tokenizer(name)
        if int(meta.get("vocab_size", tok.vocab_size)) != tok.vocab_size or int(
            meta.get("eos_id", tok.eos_id)
        ) != tok.eos_id:
            raise SteadyError(
                f"{p}: vocab_size/eos_id {meta.get('vocab_size')}/{meta.get('eos_id')} do not match "
                f"tokenizer {name!r} ({tok.vocab_size}/{tok.eos_id}); re-run prepare"
            )
        return tok
    return get_tokenizer(str(dir_or_name))
