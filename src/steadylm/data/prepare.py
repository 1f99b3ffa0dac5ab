"""`python -m steadylm.data.prepare`: text files -> tokenized HDF5 shards + tokenizer.json.

Turns documents (the embedded corpus = this interpreter's standard library sources, or the
user's .txt/.jsonl files) into `train-NNNNN.h5` / `val-NNNNN.h5` with a deterministic split.
Output is staged in a hidden folder inside `out_dir` and moved into place only when every
shard is complete, so a failed or interrupted run never leaves shards that look valid and
never mixes old and new shards.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from tqdm import tqdm

from steadylm.data.shards import token_dtype, write_shard
from steadylm.data.tokenizer import ByteTokenizer, get_tokenizer, save_tokenizer
from steadylm.errors import ConfigError, DataError, SteadyError

SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
TEXT_SUFFIXES = (".txt", ".jsonl")
DEFAULT_DIR = "data/stdlib"


def stdlib_files() -> list[Path]:
    """The embedded corpus: the running interpreter's standard library `.py` files, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files)


def resolve_inputs(input) -> list[Path]:
    """A path, glob, directory, or list of them -> sorted list of .txt/.jsonl files."""
    items = [input] if isinstance(input, (str, os.PathLike)) else list(input)
    files: list[Path] = []
    for item in items:
        s = str(item)
        if glob.has_magic(s):
            matches = sorted(Path(m) for m in glob.glob(s, recursive=True))
            matches = [m for m in matches if m.is_file()]
            if not matches:
                raise DataError(f"{s}: data.input pattern matches no files; check the path")
        else:
            p = Path(s).expanduser()
            if p.is_dir():
                matches = sorted(q for q in p.rglob("*") if q.is_file() and q.suffix in TEXT_SUFFIXES)
                if not matches:
                    raise DataError(f"{p}: data.input folder holds no .txt or .jsonl files")
            elif p.is_file():
                matches = [p]
            else:
                raise DataError(f"{p}: data.input file not found; check the path")
        for m in matches:
            if m.suffix not in TEXT_SUFFIXES:
                raise DataError(f"{m}: unsupported input type {m.suffix!r}; data.input takes .txt or .jsonl files")
        files.extend(matches)
    if not files:
        raise DataError("data.input is an empty list; give at least one .txt or .jsonl file")
    return files


def _read_text(path: Path, *, lenient: bool) -> str:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read input file ({e.strerror or e}); check it exists and is readable") from None
    try:
        return raw.decode("utf-8", errors="replace" if lenient else "strict")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: is not UTF-8 text ({e.reason} at byte {e.start}); convert it to UTF-8") from None


def iter_documents(files: list[Path], *, lenient: bool = False) -> Iterator[str]:
    """.txt: one document per file; .jsonl: one document per line (field `text`)."""
    for path in files:
        text = _read_text(path, lenient=lenient)
        if path.suffix != ".jsonl":
            yield text
            continue
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise DataError(f"{path}:{lineno}: invalid JSON ({e}); each line must be one JSON object") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                raise DataError(f"{path}:{lineno}: no string field 'text'; each line must look like {{\"text\": \"...\"}}")
            yield obj["text"]


def _cap_bytes(docs: Iterable[str], max_bytes: int | None) -> Iterator[str]:
    """Stop after `max_bytes` UTF-8 bytes of text; the last document is cut to fit."""
    if max_bytes is None:
        yield from docs
        return
    left = int(max_bytes)
    for doc in docs:
        if left <= 0:
            return
        b = doc.encode("utf-8")
        if len(b) > left:
            doc = b[:left].decode("utf-8", errors="ignore")
            b = doc.encode("utf-8")
        left -= len(b)
        yield doc


class _SplitWriter:
    """Buffers one split's tokens and writes a shard each time `shard_tokens` accumulate."""

    def __init__(self, split: str, stage: Path, tok, shard_tokens: int):
        self.split, self.stage, self.tok, self.shard_tokens = split, stage, tok, shard_tokens
        self.dtype = token_dtype(tok.vocab_size)
        self.buf: list[np.ndarray] = []
        self.buffered = 0
        self.names: list[str] = []
        self.n_tokens = 0
        self.n_docs = 0

    def add(self, ids: np.ndarray) -> None:
        self.buf.append(ids)
        self.buffered += ids.size
        self.n_docs += 1
        while self.buffered >= self.shard_tokens:
            data = np.concatenate(self.buf)
            self._write(data[: self.shard_tokens])
            rest = data[self.shard_tokens :]
            self.buf, self.buffered = ([rest] if rest.size else []), rest.size

    def finish(self) -> None:
        if self.buffered:
            self._write(np.concatenate(self.buf))
            self.buf, self.buffered = [], 0

    def _write(self, data: np.ndarray) -> None:
        name = f"{self.split}-{len(self.names):05d}.h5"
        write_shard(self.stage / name, data, vocab_size=self.tok.vocab_size, eos_id=self.tok.eos_id, tokenizer=self.tok.name)
        self.names.append(name)
        self.n_tokens += int(data.size)


def _encode(tok, text: str, dtype) -> np.ndarray:
    if isinstance(tok, ByteTokenizer):  # fast path: the bytes are the ids
        ids = np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8).astype(dtype)
    else:
        ids = np.asarray(tok.encode(text), dtype=dtype)
    return np.append(ids, np.asarray([tok.eos_id], dtype=dtype))


def prepare(
    input=None,
    out_dir=DEFAULT_DIR,
    tokenizer: str = "bytes",
    val_fraction: float = 0.01,
    shard_tokens: int = 10_000_000,
    max_bytes: int | None = None,
    *,
    progress: bool = True,
) -> dict:
    """Tokenize documents into `out_dir/{train,val}-NNNNN.h5` + `tokenizer.json`; returns a summary."""
    if not 0 < float(val_fraction) < 1:
        raise ConfigError(f"data.val_fraction={val_fraction} must be in (0, 1), e.g. 0.01")
    every = max(1, round(1 / float(val_fraction)))
    if every < 2:
        raise ConfigError(f"data.val_fraction={val_fraction} would put every document in val; use a value <= 0.5")
    if int(shard_tokens) < 1:
        raise ConfigError(f"data.shard_tokens={shard_tokens} must be a positive number of tokens")
    if max_bytes is not None and int(max_bytes) < 1:
        raise ConfigError(f"data.max_bytes={max_bytes} must be positive (or null for no limit)")
    tok = get_tokenizer(tokenizer)

    if input is None:
        files, lenient, source = stdlib_files(), True, "embedded corpus (Python stdlib)"
        if not files:
            raise DataError(f"{sysconfig.get_paths()['stdlib']}: no standard library .py files found; set data.input")
    else:
        files, lenient = resolve_inputs(input), False
        source = f"{len(files)} input file(s)"

    out = Path(out_dir).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out))
    except OSError as e:
        raise DataError(f"{out}: output folder is not writable ({e.strerror or e}); set data.dir to a writable folder") from None

    try:
        writers = {s: _SplitWriter(s, stage, tok, int(shard_tokens)) for s in ("train", "val")}
        docs = _cap_bytes(iter_documents(files, lenient=lenient), max_bytes)
        bar = tqdm(docs, desc=f"prepare {out.name}", unit="doc", file=sys.stderr, disable=not progress, dynamic_ncols=True)
        for i, doc in enumerate(bar):
            writers["val" if i % every == 0 else "train"].add(_encode(tok, doc, writers["train"].dtype))
        bar.close()
        n_docs = writers["train"].n_docs + writers["val"].n_docs
        if writers["val"].n_docs == 0 or writers["train"].n_docs == 0:
            raise DataError(
                f"{out}: input gave {n_docs} document(s), too few for a train and a val split; "
                "give more documents (or a larger data.max_bytes)"
            )
        for w in writers.values():
            w.finish()
        save_tokenizer(tok, stage)
        # Commit: replace old shards with the new set, then drop old shards that are not in it.
        new = {n for w in writers.values() for n in w.names}
        for name in sorted(new) + ["tokenizer.json"]:
            os.replace(stage / name, out / name)
        for old in list(out.glob("train-*.h5")) + list(out.glob("val-*.h5")):
            if old.name not in new:
                old.unlink()
    except OSError as e:
        raise DataError(f"{out}: could not write prepared data ({e.strerror or e}); free space or fix permissions") from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)

    summary = {
        "out_dir": str(out),
        "source": source,
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "documents": {s: w.n_docs for s, w in writers.items()},
        "tokens": {s: w.n_tokens for s, w in writers.items()},
        "shards": {s: [str(out / n) for n in w.names] for s, w in writers.items()},
    }
    print(
        f"prepared {out}: train {summary['tokens']['train']:,} tokens in {len(writers['train'].names)} shard(s), "
        f"val {summary['tokens']['val']:,} tokens in {len(writers['val'].names)} shard(s) "
        f"({n_docs:,} docs from {source}, tokenizer {tok.name})"
    )
    return summary


# --- command line -------------------------------------------------------------------------

_KEYS = {
    "data.dir": ("out_dir", str),
    "data.input": ("input", None),
    "data.tokenizer": ("tokenizer", str),
    "data.val_fraction": ("val_fraction", float),
    "data.shard_tokens": ("shard_tokens", int),
    "data.max_bytes": ("max_bytes", int),
}


def _parse_value(raw: str):
    if raw.lower() in ("null", "none", "~", ""):
        return None
    if raw.startswith("[") and raw.endswith("]"):
        return [v.strip().strip("'\"") for v in raw[1:-1].split(",") if v.strip()]
    return raw


def parse_overrides(argv: list[str]) -> dict:
    """`data.key=value` overrides -> keyword arguments for `prepare` (swap for Hydra compose)."""
    kwargs: dict = {}
    for arg in argv:
        key, sep, raw = arg.lstrip("+").partition("=")
        if not sep:
            raise ConfigError(f"{arg!r}: expected key=value, e.g. data.dir=data/stdlib")
        if key not in _KEYS:
            if key.startswith("data."):
                continue  # other data.* keys (batch_size, ...) belong to training; ignore here
            raise ConfigError(f"{key!r}: unknown key for prepare; valid keys are {', '.join(_KEYS)}")
        name, conv = _KEYS[key]
        value = _parse_value(raw)
        try:
            kwargs[name] = value if value is None or conv is None else conv(value)
        except ValueError:
            raise ConfigError(f"{key}={raw!r}: expected a {conv.__name__}") from None
    return kwargs


PREPARE_ONLY = ("data.shard_tokens", "data.max_bytes")  # not part of the training data config


def _kwargs_from_argv(argv: list[str]) -> dict:
    """Use the project's Hydra config (`steadylm.config.compose`) when it exists, else parse here.

    `data.shard_tokens` / `data.max_bytes` are read by prepare alone, so they are parsed here
    unless the composed config declares them.
    """
    try:
        from steadylm.config import compose
    except ImportError:
        return parse_overrides(argv)
    own = [a for a in argv if a.lstrip("+").partition("=")[0] in PREPARE_ONLY]
    rest = [a for a in argv if a not in own]
    try:
        data = compose(rest).data
        kwargs = {}
        for key, (name, conv) in _KEYS.items():
            field = key.split(".", 1)[1]
            if field in data and data[field] is not None:
                v = data[field]
                kwargs[name] = v if conv is None else conv(v)
    except SteadyError:
        raise
    except Exception as e:  # Hydra composition/interpolation errors: show the message, not a traceback
        raise ConfigError(f"could not compose the config from {rest}: {e}".replace("\n", " ")) from None
    if "input" in kwargs and not isinstance(kwargs["input"], (str, os.PathLike)):
        kwargs["input"] = [str(v) for v in kwargs["input"]]
    kwargs.update(parse_overrides(own))
    return kwargs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(
            "usage: python -m steadylm.data.prepare [data.dir=DIR] [data.input=PATH|GLOB|[A,B]] "
            "[data.tokenizer=bytes|gpt2] [data.val_fraction=0.01] [data.shard_tokens=N] [data.max_bytes=N]"
        )
        return 0
    try:
        prepare(**_kwargs_from_argv(argv))
    except SteadyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
