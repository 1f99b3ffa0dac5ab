"""Tokenizers: text <-> token ids, always saved as a Hugging Face `tokenizer.json` next to the shards.

`data.tokenizer` is one of
- `bytes`: UTF-8 bytes 0..255 plus end-of-text 256; nothing to train, works offline everywhere;
- `bpe`: a byte-level BPE trained by `prepare` on the input (Hugging Face `tokenizers`, `data.vocab_size`);
- a path to any `tokenizer.json`, or to the folder holding it (a Hugging Face model's);
- a tiktoken encoding name such as `gpt2` (the `tiktoken` extra; needs network once).

Shards record that spec; `generate`, export and the eval load the tokenizer from `tokenizer.json` in the shard
folder (`load_tokenizer(dir)`), so a model never meets ids of another vocabulary. Each exposes `name`,
`vocab_size`, `eos_id`, `path`, `encode`, `decode`, `encode_batch` and `token_bytes()` (bytes behind each id).
Nothing is downloaded on import.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from steadylm.errors import DataError, SteadyError

TOKENIZER_FILE = "tokenizer.json"
EOS_TOKEN = "<|endoftext|>"
DEFAULT_BPE_VOCAB = 8192


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eos_id: int
    path: Path | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map, the alphabet of every byte-level BPE `tokenizer.json`."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _hf_tokenizers():
    try:
        import tokenizers
    except ImportError as e:  # a declared dependency; only a broken install gets here
        raise SteadyError("the `tokenizers` package is missing: run `pip install tokenizers`") from e
    return tokenizers


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus an end-of-text id 256: lossless, no files, no network. `to_hf()`: the same
    mapping as a merge-free byte-level BPE (what `tokenizer.json` holds), so `transformers` gives the same ids."""

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def __init__(self, path: Path | None = None):
        self.path = path

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def token_bytes(self) -> np.ndarray:
        return np.array([1] * 256 + [0], dtype=np.int64)

    def to_hf(self) -> Any:
        tk = _hf_tokenizers()
        m = byte_to_unicode()
        tok = tk.Tokenizer(tk.models.BPE(vocab={m[b]: b for b in range(256)}, merges=[]))
        # use_regex only splits the text into words before the (merge-free) model: same ids, much faster.
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = tk.decoders.ByteLevel()
        tok.add_special_tokens([tk.AddedToken(EOS_TOKEN, special=True, normalized=False)])
        return tok

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """Any Hugging Face `tokenizer.json` (the trained `bpe`, or a user's file). Its end-of-text token is
    `<|endoftext|>` if present, else `</s>`, `<eos>` or `[SEP]`; a tokenizer with none is refused."""

    EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|end_of_text|>", "[SEP]")

    def __init__(self, tok, *, name: str, path: Path | None = None):
        self._tok = tok
        # Document text is data: a literal "<|endoftext|>" inside it must not become the separator id.
        tok.encode_special_tokens = True
        self.name = str(name)
        self.path = path
        self.vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        eos = next((tok.token_to_id(t) for t in self.EOS_CANDIDATES if tok.token_to_id(t) is not None), None)
        if eos is None:
            raise DataError(
                f"{path or name}: tokenizer has no end-of-text token (one of {', '.join(self.EOS_CANDIDATES)}); "
                f"add one as a special token or use data.tokenizer=bpe"
            )
        self.eos_id = int(eos)

    @classmethod
    def from_file(cls, path, *, name: str | None = None) -> HFTokenizer:
        path = Path(path)
        tk = _hf_tokenizers()
        try:
            tok = tk.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception subclass for every parse error
            raise DataError(
                f"{path}: not a loadable tokenizer.json ({str(e).splitlines()[0]}); check data.tokenizer"
            ) from None
        return cls(tok, name=name or str(path), path=path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_batch_fast (tokenizers >= 0.20) skips the character offsets, which prepare never reads.
        fast = getattr(self._tok, "encode_batch_fast", None) or self._tok.encode_batch
        return [e.ids for e in fast(texts, add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids])

    def token_bytes(self) -> np.ndarray:
        """Bytes behind each id: exact for byte-level vocabularies, else the UTF-8 length of the id's decoded text."""
        inv = {c: b for b, c in byte_to_unicode().items()}
        special = {int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for piece, i in self._tok.get_vocab(with_added_tokens=True).items():
            if i in special or i >= self.vocab_size:
                continue
            if all(c in inv for c in piece):
                out[i] = len(piece)
            else:
                out[i] = len(self._tok.decode([i]).encode("utf-8"))
        return out

    def to_hf(self) -> Any:
        return self._tok

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


class TiktokenTokenizer:
    """A tiktoken encoding (`gpt2`, `cl100k_base`, ...), imported lazily; its vocabulary is fetched once."""

    def __init__(self, name: str = "gpt2") -> None:
        try:
            import tiktoken
        except ImportError as e:
            raise SteadyError(
                f"tokenizer {name!r} needs the tiktoken package: run `pip install tiktoken` "
                "(it also needs network once to download the vocabulary), or use data.tokenizer=bytes or bpe"
            ) from e
        try:
            self._enc = tiktoken.get_encoding(name)
        except Exception as e:  # network/cache failures surface as many exception types
            raise SteadyError(
                f"tokenizer {name!r}: tiktoken could not load it ({type(e).__name__}: {e}); "
                "it needs network once to download the vocabulary (`pip install tiktoken` and retry online), "
                "or use data.tokenizer=bytes or bpe"
            ) from e
        self.name = name
        self.path = None
        self.eos_id = int(self._enc.eot_token)
        self.vocab_size = int(self._enc.n_vocab)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids) -> str:
        return self._enc.decode([int(i) for i in ids if int(i) != self.eos_id])

    def token_bytes(self) -> np.ndarray:
        out = np.zeros(self.vocab_size, dtype=np.int64)
        for i in range(self.vocab_size):
            if i != self.eos_id:
                try:
                    out[i] = len(self._enc.decode_single_token_bytes(i))
                except KeyError:
                    pass
        return out

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.name!r})"


def _tiktoken_names() -> set[str]:
    try:
        import tiktoken
    except ImportError:
        return {"gpt2", "r50k_base", "p50k_base", "cl100k_base", "o200k_base"}
    return set(tiktoken.list_encoding_names())


def get_tokenizer(spec) -> Tokenizer:
    """A tokenizer that needs no training: `bytes`, a `tokenizer.json` path, or a tiktoken name (`bpe` is
    trained by `prepare` and loaded from the shard folder)."""
    s = str(spec)
    if s == "bytes":
        return ByteTokenizer()
    if s == "bpe":
        raise SteadyError(
            "tokenizer 'bpe' is trained by prepare and saved next to the shards: load it with "
            "load_tokenizer(data.dir) (run `python -m steadylm.data.prepare data.tokenizer=bpe` first)"
        )
    p = Path(s).expanduser()
    if s.endswith(".json") or p.is_file() or (p / TOKENIZER_FILE).is_file():  # a folder: a Hugging Face model's
        if not (p.is_file() or (p / TOKENIZER_FILE).is_file()):
            raise SteadyError(f"{p}: tokenizer file not found (data.tokenizer); give an existing tokenizer.json")
        return load_tokenizer(p)
    if s in _tiktoken_names():
        return TiktokenTokenizer(s)
    raise SteadyError(
        f"unknown tokenizer {s!r} (data.tokenizer): use bytes, bpe, a path to a tokenizer.json, "
        "or a tiktoken name such as gpt2"
    )


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_BPE_VOCAB) -> HFTokenizer:
    """Train a GPT-2-style byte-level BPE with `<|endoftext|>` (id 0) on `texts`, offline."""
    tk = _hf_tokenizers()
    if int(vocab_size) < 257:
        raise SteadyError(f"data.vocab_size={vocab_size} is too small for a byte-level BPE; use >= 257 (e.g. 8192)")
    tok = tk.Tokenizer(tk.models.BPE())
    tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=int(vocab_size),
        special_tokens=[EOS_TOKEN],
        initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return HFTokenizer(tok, name="bpe")


def save_tokenizer(tok, directory) -> Path:
    """Write `directory/tokenizer.json` (Hugging Face format when the tokenizer has one); returns its path."""
    path = Path(directory) / TOKENIZER_FILE
    tmp = path.with_suffix(".json.partial")
    if hasattr(tok, "to_hf"):
        text = tok.to_hf().to_str(pretty=True)
    else:  # tiktoken: no Hugging Face form; record the name to reload it by
        text = json.dumps({"name": tok.name, "vocab_size": int(tok.vocab_size), "eos_id": int(tok.eos_id)}, indent=2)
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def _is_bytes_spec(obj: dict) -> bool:
    model = obj.get("model") or {}
    added = obj.get("added_tokens") or []
    vocab = model.get("vocab") or {}
    m = byte_to_unicode()
    return (
        model.get("type") == "BPE"
        and not model.get("merges")
        and len(vocab) == 256
        and all(vocab.get(m[b]) == b for b in range(256))
        and [(t.get("id"), t.get("content")) for t in added] == [(256, EOS_TOKEN)]
    )


def load_tokenizer(dir_or_file) -> Tokenizer:
    """The tokenizer saved with a set of shards: a folder holding `tokenizer.json`, or that file (or a bare
    name such as `bytes` or `gpt2`, for callers that only have the shard attribute)."""
    p = Path(dir_or_file).expanduser()
    if p.is_dir():
        p = p / TOKENIZER_FILE
    elif not (p.suffix == ".json" or p.is_file()):
        return get_tokenizer(str(dir_or_file))
    if not p.is_file():
        raise SteadyError(f"{p}: tokenizer file not found; run `python -m steadylm.data.prepare` to create it")
    try:
        obj = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise SteadyError(f"{p}: not a valid tokenizer.json ({e}); re-run prepare to rewrite it") from None
    if isinstance(obj, dict) and "name" in obj and "model" not in obj:  # the short form (older shards, tiktoken)
        tok = get_tokenizer(obj["name"])
        recorded = (int(obj.get("vocab_size", tok.vocab_size)), int(obj.get("eos_id", tok.eos_id)))
        if recorded != (tok.vocab_size, tok.eos_id):
            raise SteadyError(
                f"{p}: vocab_size/eos_id {obj.get('vocab_size')}/{obj.get('eos_id')} do not match "
                f"tokenizer {obj['name']!r} ({tok.vocab_size}/{tok.eos_id}); re-run prepare"
            )
        tok.path = p
        return tok
    if isinstance(obj, dict) and _is_bytes_spec(obj):
        return ByteTokenizer(path=p)
    return HFTokenizer.from_file(p, name=str(p))


def same_tokenizer(recorded: str, configured) -> bool:
    """Shards record the `data.tokenizer` spec that made them; a path may be spelled differently, name the folder
    holding the file (a Hugging Face model's), or be a copy of it (the same JSON)."""
    a, b = (
        p / TOKENIZER_FILE if p.is_dir() else p for p in (Path(str(s)).expanduser() for s in (recorded, configured))
    )
    if recorded == str(configured) or not (a.is_file() and b.is_file()):
        return recorded == str(configured)
    return a.resolve() == b.resolve() or json.loads(a.read_bytes()) == json.loads(b.read_bytes())  # read by now


def tokenizer_of_run(meta: dict) -> Tokenizer:
    """The tokenizer a training run used, from its checkpoint's `steadylm` metadata: the recorded spec, or
    (`bpe`, or a spec whose file is gone) `tokenizer.json` in the run's `data.dir`, where prepare saved it."""
    spec = str(meta.get("tokenizer") or "bytes")
    data_dir = ((meta.get("config") or {}).get("data") or {}).get("dir")
    saved = Path(str(data_dir)).expanduser() / TOKENIZER_FILE if data_dir else None
    if spec == "bytes":
        return ByteTokenizer()
    if spec != "bpe" and not (saved is not None and saved.is_file()):
        return get_tokenizer(spec)
    if saved is None or not saved.is_file():
        raise SteadyError(
            f"the run's tokenizer ({spec!r}) was saved as {saved or 'data.dir/tokenizer.json'}, which is missing; "
            "re-run prepare with the run's data settings or copy tokenizer.json back"
        )
    return load_tokenizer(saved)
