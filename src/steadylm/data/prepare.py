"""`python -m steadylm.data.prepare`: text -> tokenized HDF5 shards (format 2) + tokenizer.json.

Turns documents (the embedded corpus = this interpreter's standard library sources, or `data.input`:
files, folders, globs, parquet, `datasets` folders, see `readers`) into `train-NNNNN.h5` / `val-NNNNN.h5`.

How it runs, and what it guarantees:
1. tokenizer: `bytes` (the default), a `tokenizer.json`, a tiktoken name, or `bpe` trained here on (a sample of)
   the input, its vocabulary following the sample's size unless `data.vocab_size` is set (`bpe_vocab_size`);
2. encode: the input is cut into work units (`readers.plan_units`, independent of `data.num_proc`); each of
   `num_proc` processes reads and encodes one unit at a time, streaming ids to a file in the staging folder,
   so memory stays bounded whatever the input size;
3. merge: units are concatenated in input order; val takes `val_fraction` of the tokens, exactly, as evenly
   spaced slices of that stream (`val_slices`: a slice may cut a document); shards of `shard_tokens` ids are
   written with `n_bytes` (UTF-8 bytes behind their ids).
The same input gives byte-identical shards for every `num_proc`. All work happens in `out_dir/.prepare-<key>`,
whose key hashes the inputs and settings; shards are moved into place only when every one is complete
(tokenizer.json last of all), so an interrupted run leaves nothing training would accept, and re-running
the same command resumes from the units already encoded (a different command starts clean).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import multiprocessing as mp
import os
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from itertools import chain, islice
from pathlib import Path

import h5py
import numpy as np
from omegaconf import DictConfig
from tqdm import tqdm

from steadylm.cli import run_command
from steadylm.data.readers import ReadStats, Unit, doc_units, plan_units, read_unit, resolve_inputs
from steadylm.data.shards import DATASET, FORMAT_VERSION, ShardInfo
from steadylm.data.tokenizer import (
    ByteTokenizer,
    get_tokenizer,
    load_tokenizer,
    save_tokenizer,
    train_bpe,
)
from steadylm.errors import ConfigError, DataError, SteadyError

SKIP_DIRS = {"site-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
DEFAULT_DIR = "data/stdlib"
BATCH_CHARS = 1 << 20  # characters per encode_batch call
# Text the BPE is trained on (the start of the input): bounds its memory. The trainer holds every distinct
# word: 100 MB of very diverse synthetic text (3 M distinct words) peaked at 0.97 GB RSS, so 64 MB stays under 1 GB.
BPE_SAMPLE_BYTES = 64 << 20
# data.vocab_size=null for bpe: the power of two nearest sqrt(bytes the BPE trains on), within these bounds
# (300 KB of text -> 512, 12 MB -> 4096, the 64 MB sample -> 8192): a vocabulary the text can fill, so a small
# corpus does not give a model that is mostly embedding.
BPE_VOCAB_RANGE = (512, 32768)
VAL_SLICE_TOKENS = 2048  # the shortest val slice: many model windows long, so few windows straddle two slices
MAX_VAL_SLICES = 100
STAGE_PREFIX = ".prepare-"
CHUNK_TOKENS = 64 * 1024


def stdlib_files() -> list[Path]:
    """The embedded corpus: the running interpreter's standard library `.py` files, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        files.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(files)


def cap_pieces(pieces: Iterable[tuple[str, bool]], max_bytes: int | None) -> Iterator[tuple[str, bool]]:
    """Stop after `max_bytes` UTF-8 bytes of text; the last document is cut to fit and ended."""
    if max_bytes is None:
        yield from pieces
        return
    left = int(max_bytes)
    for text, end in pieces:
        if left <= 0:
            return
        b = text.encode("utf-8", errors="replace")
        if len(b) >= left:
            if len(b) > left:
                text = b[:left].decode("utf-8", errors="ignore")
            left = 0
            yield text, True
            return
        left -= len(b)
        yield text, end


# --- encoding one unit (runs in a worker process, or inline when num_proc=1) -------------------------------

_WORKER_TOK: dict[str, object] = {}


def _worker_tokenizer(tok_dir: str):
    tok = _WORKER_TOK.get(tok_dir)
    if tok is None:
        tok = _WORKER_TOK[tok_dir] = load_tokenizer(tok_dir)
    return tok


def _unit_paths(stage: Path, k: int) -> tuple[Path, Path]:
    base = stage / "units" / f"{k:07d}"
    return base.with_suffix(".tok"), base.with_suffix(".json")


def _encode_texts(tok, texts: list[str], dtype) -> tuple[np.ndarray, list[int]]:
    """Ids of `texts` back to back, and each text's id count."""
    if isinstance(tok, ByteTokenizer):  # the UTF-8 bytes are the ids
        encoded = [t.encode("utf-8", errors="replace") for t in texts]
        return np.frombuffer(b"".join(encoded), dtype=np.uint8).astype(dtype), [len(e) for e in encoded]
    try:
        ids = tok.encode_batch(texts)
    except (UnicodeEncodeError, TypeError):  # lone surrogates from JSON escapes: encode what UTF-8 can hold
        ids = tok.encode_batch([t.encode("utf-8", errors="replace").decode("utf-8") for t in texts])
    return np.fromiter(chain.from_iterable(ids), dtype=dtype), [len(i) for i in ids]


def encode_unit(job: dict) -> dict:
    """Read and encode one unit into `<stage>/units/K.{tok,len}`; `K.json` is written last (the done mark)."""
    stage, k, unit = Path(job["stage"]), job["k"], job["unit"]
    tok = _worker_tokenizer(job["tok_dir"])
    dtype = token_dtype(tok.vocab_size)
    eos = np.asarray([tok.eos_id], dtype=dtype)
    tok_path, meta_path = _unit_paths(stage, k)
    stats = ReadStats()
    n_docs = n_tokens = 0
    in_doc = False  # the last text did not end its document
    with open(tok_path.with_suffix(".tok.partial"), "wb") as ft:
        batch: list[tuple[str, bool]] = []
        chars = 0

        def flush():
            nonlocal in_doc, n_docs, n_tokens
            ids, counts = _encode_texts(tok, [t for t, _ in batch], dtype)
            # Insert eos after every text that ends a document, in one vectorised pass.
            ends = np.cumsum(counts)[[e for _, e in batch]] if any(e for _, e in batch) else np.zeros(0, np.int64)
            if ends.size:
                ids = np.insert(ids, ends, eos[0])
            ft.write(ids.tobytes())
            n_tokens += int(ids.size)
            n_docs += sum(1 for _, e in batch if e)
            in_doc = not batch[-1][1]
            batch.clear()

        for text, end in read_unit(
            unit, text_field=job["text_field"], lenient=job["lenient"], skip=job["skip"], stats=stats
        ):
            batch.append((text, end))
            chars += len(text)
            if chars >= BATCH_CHARS:
                flush()
                chars = 0
        if batch:
            flush()
    if in_doc:  # a reader that stopped inside a document (skip mode): end it
        with open(tok_path.with_suffix(".tok.partial"), "ab") as ft:
            ft.write(eos.tobytes())
        n_docs += 1
        n_tokens += 1
    os.replace(tok_path.with_suffix(".tok.partial"), tok_path)
    meta = {
        "k": k,
        "docs": n_docs,
        "tokens": n_tokens,
        "bytes_in": unit.nbytes,
        "skipped": stats.skipped,
        "first_skip": stats.first_skip,
    }
    meta_path.with_suffix(".json.partial").write_text(json.dumps(meta))
    os.replace(meta_path.with_suffix(".json.partial"), meta_path)
    return meta


def _restore_env(name: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _worker_init() -> None:
    # One thread per process: num_proc processes are the parallelism, and tokenizers' own pool would oversubscribe.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# --- merging units into shards --------------------------------------------------------------------------


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if int(vocab_size) <= 65536 else np.dtype(np.uint32)


def write_shard(
    path, tokens: np.ndarray, *, vocab_size: int, eos_id: int, tokenizer: str, n_bytes: int | None = None
) -> ShardInfo:
    """Write `tokens` to `path` atomically (nothing appears on failure); format 2 with `n_bytes`, else format 1."""
    path = Path(path)
    partial = path.with_suffix(".h5.partial")
    try:
        arr = np.asarray(tokens)
        if arr.ndim != 1 or arr.size == 0:
            raise DataError(
                f"{path}: refusing to write a shard of shape {arr.shape}; tokens must be a non-empty 1-D array"
            )
        if arr.dtype.kind not in "ui":
            raise DataError(f"{path}: refusing to write tokens of dtype {arr.dtype}; token ids must be integers")
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= vocab_size:
            raise DataError(
                f"{path}: token ids span {lo}..{hi} but vocab_size is {vocab_size}; the tokenizer and vocab_size disagree"
            )
        if not 0 <= eos_id < vocab_size:
            raise DataError(f"{path}: eos_id {eos_id} is outside vocab_size {vocab_size}")
        data = arr.astype(token_dtype(vocab_size), copy=False)
        version, n_bytes = (1, None) if n_bytes is None else (2, int(n_bytes))
        info = ShardInfo(
            path, data.size, int(vocab_size), int(eos_id), str(tokenizer), hi, data.dtype.name, n_bytes, version
        )
        with h5py.File(partial, "w") as f:
            ds = f.create_dataset(DATASET, shape=data.shape, dtype=data.dtype, chunks=(min(CHUNK_TOKENS, data.size),))
            for name in ("vocab_size", "eos_id", "tokenizer"):
                f.attrs[name] = getattr(info, name)
            ds[...] = data
            # Written last: a reader that sees them knows the data before them is complete.
            for name in ("n_tokens", "max_token_id", "n_bytes", "format_version"):
                if getattr(info, name) is not None:
                    f.attrs[name] = getattr(info, name)
        os.replace(partial, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        if isinstance(e, DataError) or not isinstance(e, Exception):
            raise
        raise DataError(
            f"{path}: could not write shard ({type(e).__name__}: {e}); nothing was left behind, "
            "free disk space or fix the output folder and re-run prepare"
        ) from e
    return info


class _SplitWriter:
    """Buffers one split's tokens and writes a format-2 shard each time `shard_tokens` accumulate."""

    def __init__(self, split: str, stage: Path, tok, spec: str, shard_tokens: int, token_bytes: np.ndarray):
        self.split, self.stage, self.tok, self.spec, self.shard_tokens = split, stage, tok, spec, shard_tokens
        # Bytes behind each id, in the smallest dtype that holds them: one gather + sum per shard.
        self.token_bytes = token_bytes.astype(np.uint16 if token_bytes.max(initial=0) < 65536 else np.int64)
        zero = np.flatnonzero(token_bytes == 0)
        self.zero_byte_ids = zero.tolist() if len(zero) <= 4 and np.all(np.delete(token_bytes, zero) == 1) else None
        self.buf: list[np.ndarray] = []
        self.buffered = 0
        self.names: list[str] = []
        self.n_tokens = 0
        self.n_bytes = 0
        self.n_docs = 0

    def add(self, ids: np.ndarray) -> None:
        while ids.size:
            take = min(ids.size, self.shard_tokens - self.buffered)
            self.buf.append(np.array(ids[:take]))
            self.buffered += take
            ids = ids[take:]
            if self.buffered == self.shard_tokens:
                self._write()

    def finish(self) -> None:
        if self.buffered:
            self._write()

    def _write(self) -> None:
        data = np.concatenate(self.buf)
        self.buf, self.buffered = [], 0
        if self.zero_byte_ids is not None:  # every other id is one byte (the bytes tokenizer): just count
            n_bytes = int(data.size - sum(np.count_nonzero(data == i) for i in self.zero_byte_ids))
        else:
            n_bytes = int(np.take(self.token_bytes, data).sum(dtype=np.int64))
        name = f"{self.split}-{len(self.names):05d}.h5"
        write_shard(
            self.stage / name,
            data,
            vocab_size=self.tok.vocab_size,
            eos_id=self.tok.eos_id,
            tokenizer=self.spec,
            n_bytes=n_bytes,
        )
        self.names.append(name)
        self.n_tokens += int(data.size)
        self.n_bytes += n_bytes


def val_slices(n_tokens: int, val_fraction: float) -> list[tuple[int, int]]:
    """The val split as [start, stop) ranges of the input's token stream: round(val_fraction x n_tokens) tokens
    exactly, whatever the documents' sizes, as the ends of k equal parts of the stream (k up to 100, each slice
    at least VAL_SLICE_TOKENS long), so val samples the whole input, not its first or last file."""
    n_val = round(float(val_fraction) * n_tokens)
    k = max(1, min(MAX_VAL_SLICES, n_val // VAL_SLICE_TOKENS))
    slices = []
    for b in range(k):
        end = n_tokens * (b + 1) // k
        slices.append((end - (n_val * (b + 1) // k - n_val * b // k), end))
    return slices


def _merge(stage: Path, n_units: int, writers: dict[str, _SplitWriter], slices: list[tuple[int, int]], dtype) -> None:
    """Concatenate the units in order, sending the tokens inside `slices` to val and the rest to train."""
    bounds = [b for s in slices for b in s]  # sorted: the split flips at each
    offset = 0
    for k in range(n_units):
        tok_path = _unit_paths(stage, k)[0]
        n = tok_path.stat().st_size // np.dtype(dtype).itemsize
        if not n:
            continue
        ids = np.memmap(tok_path, dtype=dtype, mode="r")
        cuts = [0, *(b - offset for b in bounds if offset < b < offset + n), n]
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            # Bounds at or before `offset + lo` flipped the split that many times, starting in train.
            val = sum(b <= offset + lo for b in bounds) % 2 == 1
            w = writers["val" if val else "train"]
            piece = ids[lo:hi]
            w.add(piece)
            w.n_docs += int(np.count_nonzero(piece == w.tok.eos_id))
        offset += n
        del ids


# --- the run ---------------------------------------------------------------------------------------------


def _resolve_num_proc(num_proc) -> int:
    if num_proc is None or str(num_proc).lower() in ("", "null", "none", "auto", "0"):
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    n = int(num_proc)
    if n < 1:
        raise ConfigError(f"data.num_proc={num_proc} must be >= 1 (or null for all cores)")
    return n


def _fingerprint(inputs, settings: dict) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for kind, path in inputs:
        if kind == "hub":
            h.update(f"hub:{path}".encode())
            continue
        st = os.stat(path)
        h.update(f"{kind}:{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def bpe_vocab_size(n_bytes: int) -> int:
    """The default BPE vocabulary for `n_bytes` of training text (BPE_VOCAB_RANGE's comment)."""
    lo, hi = BPE_VOCAB_RANGE
    return min(hi, max(lo, 2 ** round(math.log2(max(1.0, math.sqrt(n_bytes))))))


def _make_tokenizer(spec: str, vocab_size, stage: Path, pieces, bpe_sample_bytes: int, progress: bool):
    """The tokenizer, saved as `stage/tokenizer.json` (reused there when resuming a BPE run)."""
    if spec == "bpe":
        if (stage / "tokenizer.json").is_file():
            return load_tokenizer(stage)
        texts = [t for t, _ in cap_pieces(pieces(), bpe_sample_bytes)]
        n_bytes = sum(len(t.encode("utf-8", errors="replace")) for t in texts)
        vocab = bpe_vocab_size(n_bytes) if vocab_size is None else int(vocab_size)
        how = (
            "data.vocab_size"
            if vocab_size is not None
            else "the power of two nearest sqrt(bytes); data.vocab_size sets it"
        )
        if progress:
            print(f"prepare: training a byte-level BPE, vocab {vocab} ({how}), on {n_bytes:,} bytes", file=sys.stderr)
        tok = train_bpe(texts, vocab)
    else:
        tok = get_tokenizer(spec)
    save_tokenizer(tok, stage)
    return tok


def prepare(
    input=None,
    out_dir=DEFAULT_DIR,
    tokenizer: str | None = "bytes",
    val_fraction: float = 0.01,
    shard_tokens: int = 10_000_000,
    max_bytes: int | None = None,
    *,
    text_field: str = "text",
    vocab_size: int | None = None,
    num_proc: int | None = None,
    on_bad_record: str = "error",
    bpe_sample_bytes: int = BPE_SAMPLE_BYTES,
    progress: bool = True,
) -> dict:
    """Tokenize documents into `out_dir/{train,val}-NNNNN.h5` + `tokenizer.json`; returns a summary."""
    if not 0 < float(val_fraction) <= 0.5:
        raise ConfigError(f"data.val_fraction={val_fraction} must be in (0, 0.5], e.g. 0.01")
    if int(shard_tokens) < 1:
        raise ConfigError(f"data.shard_tokens={shard_tokens} must be a positive number of tokens")
    if max_bytes is not None and int(max_bytes) < 1:
        raise ConfigError(f"data.max_bytes={max_bytes} must be positive (or null for no limit)")
    if on_bad_record not in ("error", "skip"):
        raise ConfigError(f"data.on_bad_record={on_bad_record!r} must be error or skip")
    procs = _resolve_num_proc(num_proc)
    spec = str(tokenizer or "bytes")
    if spec != "bpe":
        get_tokenizer(spec)  # refuse an unknown name before reading anything

    if input is None:
        files = stdlib_files()
        if not files:
            raise DataError(f"{sysconfig.get_paths()['stdlib']}: no standard library .py files found; set data.input")
        inputs, lenient, source = [("txt", f) for f in files], True, "embedded corpus (Python stdlib)"
    else:
        inputs, lenient = resolve_inputs(input), False
        source = f"{len(inputs)} input(s)"
    skip = on_bad_record == "skip"

    out = Path(out_dir).expanduser()
    settings = {
        "format": FORMAT_VERSION,
        "tokenizer": spec,
        "vocab_size": vocab_size,
        "text_field": text_field,
        "lenient": lenient,
        "skip": skip,
        "max_bytes": max_bytes,
        "bpe_sample_bytes": bpe_sample_bytes,
    }
    if spec not in ("bytes", "bpe") and Path(spec).expanduser().is_file():
        settings["tokenizer_sha"] = hashlib.sha256(Path(spec).expanduser().read_bytes()).hexdigest()
    key = _fingerprint(inputs, settings)
    try:
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob(STAGE_PREFIX + "*"):  # another command's leftovers: start clean
            if old.name != STAGE_PREFIX + key:
                shutil.rmtree(old, ignore_errors=True)
        stage = out / (STAGE_PREFIX + key)
        (stage / "units").mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(
            f"{out}: output folder is not writable ({e.strerror or e}); set data.dir to a writable folder"
        ) from None

    def units() -> Iterator[Unit]:
        if max_bytes is None:
            return plan_units(inputs, text_field)
        return doc_units(capped())

    def capped() -> Iterator[tuple[str, bool]]:
        stats = ReadStats()
        pieces = (
            p
            for u in plan_units(inputs, text_field)
            for p in read_unit(u, text_field=text_field, lenient=lenient, skip=skip, stats=stats)
        )
        return cap_pieces(pieces, max_bytes)

    def all_pieces() -> Iterator[tuple[str, bool]]:
        return (p for u in units() for p in read_unit(u, text_field=text_field, lenient=lenient, skip=skip))

    t0 = time.perf_counter()
    try:
        tok = _make_tokenizer(spec, vocab_size, stage, all_pieces, int(bpe_sample_bytes), progress)
        metas, resumed, procs = _encode_all(
            units(),
            stage,
            text_field,
            lenient,
            skip,
            procs,
            progress,
            out.name,
            pool_min_units=4 if isinstance(tok, ByteTokenizer) else 2,
        )
        n_docs = sum(m["docs"] for m in metas)
        if n_docs == 0:
            raise DataError(f"{out}: the input holds no documents (every file empty or skipped); check data.input")
        writers = {s: _SplitWriter(s, stage, tok, spec, int(shard_tokens), tok.token_bytes()) for s in ("train", "val")}
        t_merge = time.perf_counter()
        n_tokens = sum(m["tokens"] for m in metas)
        slices = val_slices(n_tokens, float(val_fraction))
        _merge(stage, len(metas), writers, slices, token_dtype(tok.vocab_size))
        for w in writers.values():
            w.finish()
        if not writers["val"].n_tokens or not writers["train"].n_tokens:
            raise DataError(
                f"{out}: input gave {n_tokens} token(s), too few for a train and a val split at "
                f"data.val_fraction={val_fraction}; give more text (or a larger data.max_bytes)"
            )
        # Commit: move the new shards in, drop old shards not in the new set, tokenizer.json last.
        new = {n for w in writers.values() for n in w.names}
        for name in sorted(new):
            os.replace(stage / name, out / name)
        for old in list(out.glob("train-*.h5")) + list(out.glob("val-*.h5")):
            if old.name not in new:
                old.unlink()
        os.replace(stage / "tokenizer.json", out / "tokenizer.json")
        t_merge = time.perf_counter() - t_merge
        shutil.rmtree(stage, ignore_errors=True)
    except SteadyError:
        shutil.rmtree(stage, ignore_errors=True)  # bad input or settings: the next run starts clean
        raise
    except OSError as e:
        raise DataError(
            f"{out}: could not write prepared data ({e.strerror or e}); free space or fix permissions, "
            "then re-run (it resumes)"
        ) from None
    # Anything else (Ctrl-C, a killed worker) leaves the staging folder for the next identical run to resume.

    seconds = time.perf_counter() - t0
    bytes_in = sum(m["bytes_in"] for m in metas)
    skipped = sum(m["skipped"] for m in metas)
    summary = {
        "out_dir": str(out),
        "source": source,
        "tokenizer": spec,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "documents": {s: w.n_docs for s, w in writers.items()},
        "tokens": {s: w.n_tokens for s, w in writers.items()},
        "bytes": {s: w.n_bytes for s, w in writers.items()},
        "shards": {s: [str(out / n) for n in w.names] for s, w in writers.items()},
        "skipped_records": skipped,
        "first_skipped": next((m["first_skip"] for m in metas if m["first_skip"]), None),
        "units": len(metas),
        "resumed_units": resumed,
        "num_proc": procs,
        "seconds": seconds,
        "merge_seconds": t_merge,  # concatenating the encoded units into shards (one process)
        "input_bytes": bytes_in,
        "val_slices": len(slices),
    }
    print(report(summary, out_dir, float(val_fraction)))
    return summary


def report(summary: dict, out_dir, val_fraction: float) -> str:
    """What prepare made, the split it chose, and the command that trains on it."""
    tokens, shards, docs = summary["tokens"], summary["shards"], summary["documents"]
    total = tokens["train"] + tokens["val"]
    skipped, resumed = summary["skipped_records"], summary["resumed_units"]
    return "\n".join(
        [
            f"prepared {summary['out_dir']}: {sum(docs.values()):,} docs from {summary['source']}, "
            f"{summary['input_bytes']:,} bytes -> {total:,} tokens, tokenizer {summary['tokenizer']} "
            f"(vocab {summary['vocab_size']:,}, tokenizer.json beside the shards), {summary['num_proc']} process(es), "
            f"{summary['input_bytes'] / 1e6 / max(summary['seconds'], 1e-9):.1f} MB/s"
            + (f"; skipped {skipped:,} bad record(s), first: {summary['first_skipped']}" if skipped else "")
            + (f"; resumed {resumed} unit(s) from an interrupted run" if resumed else ""),
            f"  split: train {tokens['train']:,} tokens in {len(shards['train'])} shard(s), val {tokens['val']:,} "
            f"tokens ({tokens['val'] / max(total, 1):.2%}; data.val_fraction={val_fraction:g}) in "
            f"{len(shards['val'])} shard(s), taken as {summary['val_slices']} evenly spaced slice(s) of the input",
            f"  train on it: python train.py data.dir={out_dir}",
        ]
    )


def _encode_all(
    units: Iterator[Unit],
    stage: Path,
    text_field: str,
    lenient: bool,
    skip: bool,
    procs: int,
    progress: bool,
    label: str,
    pool_min_units: int = 2,
) -> tuple[list[dict], int, int]:
    """Encode every unit (skipping those a previous identical run finished).

    Returns their metas in order, the number resumed, and the number of processes used.
    """
    metas: dict[int, dict] = {}
    resumed = 0
    bar = tqdm(
        desc=f"prepare {label}",
        unit="B",
        unit_scale=True,
        file=sys.stderr,
        disable=not progress,
        dynamic_ncols=True,
        mininterval=0.5,
        delay=1.0,
    )  # delay: a quick failure prints only its error
    docs = tokens = 0

    def done(meta: dict) -> None:
        nonlocal docs, tokens
        metas[meta["k"]] = meta
        docs += meta["docs"]
        tokens += meta["tokens"]
        bar.update(meta["bytes_in"])
        bar.set_postfix_str(f"{docs:,} docs, {tokens:,} tokens", refresh=False)

    def jobs() -> Iterator[dict]:
        nonlocal resumed
        for k, unit in enumerate(units):
            meta_path = _unit_paths(stage, k)[1]
            if meta_path.is_file():
                try:
                    done(json.loads(meta_path.read_text()))
                    resumed += 1
                    continue
                except (OSError, ValueError, KeyError):
                    pass
            yield {
                "stage": str(stage),
                "k": k,
                "unit": unit,
                "tok_dir": str(stage),
                "text_field": text_field,
                "lenient": lenient,
                "skip": skip,
            }

    # Starting a process takes ~0.5 s: worth it only with several units (bytes encodes ~150 MB/s inline).
    units = iter(units)
    head = list(islice(units, pool_min_units))
    if len(head) < pool_min_units:
        procs = 1
    units = chain(head, units)
    _WORKER_TOK.clear()
    try:
        if procs == 1:
            saved = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            try:
                for job in jobs():
                    done(encode_unit(job))
            finally:
                _restore_env("TOKENIZERS_PARALLELISM", saved)
        else:
            # fork on Linux: workers start in milliseconds and need no importable __main__ (stdin, notebooks).
            # The variable tells tokenizers its pool is off in the forked workers (no fork warning, no deadlock).
            method = "fork" if sys.platform == "linux" else "spawn"
            saved = os.environ.get("TOKENIZERS_PARALLELISM")
            os.environ["TOKENIZERS_PARALLELISM"] = "false"
            with ProcessPoolExecutor(procs, mp_context=mp.get_context(method), initializer=_worker_init) as pool:
                pending: dict = {}
                errors: list[tuple[int, BaseException]] = []

                def collect(futures) -> None:
                    for f in futures:
                        k = pending.pop(f)
                        try:
                            done(f.result())
                        except Exception as e:  # noqa: PERF203
                            errors.append((k, e))

                try:
                    for job in jobs():
                        pending[pool.submit(encode_unit, job)] = job["k"]
                        if len(pending) >= 2 * procs:  # bounded: never more than 2 units per process in flight
                            collect(wait(pending, return_when=FIRST_COMPLETED)[0])
                        if errors:
                            break
                    # Every earlier unit was submitted before a failing one: after they finish, the error
                    # reported is the first in input order, whatever the timing.
                    collect(list(pending))
                    if errors:
                        raise min(errors, key=lambda e: e[0])[1]
                except BaseException:
                    for f in pending:
                        f.cancel()
                    raise
                finally:
                    _restore_env("TOKENIZERS_PARALLELISM", saved)
    finally:
        bar.close()
    return [metas[k] for k in sorted(metas)], resumed, procs


# --- command line -------------------------------------------------------------------------

# data.<key> -> prepare()'s argument (the rest of the composed config belongs to training)
ARGUMENTS = {
    "dir": "out_dir",
    "input": "input",
    "tokenizer": "tokenizer",
    "val_fraction": "val_fraction",
    "text_field": "text_field",
    "vocab_size": "vocab_size",
    "num_proc": "num_proc",
    "on_bad_record": "on_bad_record",
    "shard_tokens": "shard_tokens",
    "max_bytes": "max_bytes",
    "bpe_sample_bytes": "bpe_sample_bytes",
}
USAGE = """Tokenize text into HDF5 shards, with the same `key=value` overrides as train.py (conf/prepare.yaml).

  data.dir=DIR                      where the shards and tokenizer.json go (training reads the same key)
  data.input=PATH|GLOB|hf:NAME|[A,B] .txt .jsonl .jsonl.gz .jsonl.zst .parquet, datasets folders; null: the stdlib
  data.text_field=text              the JSON key / column of each document
  data.tokenizer=bytes|bpe|PATH/tokenizer.json|gpt2
  data.vocab_size=N                 for data.tokenizer=bpe (null: the power of two nearest sqrt(text bytes), 512..32768)
  data.num_proc=N                   reading/encoding processes (null: all cores; the shards are identical for any N)
  data.on_bad_record=error|skip     data.val_fraction=0.01   experiment=demo (the demo's BPE data)"""


def prepare_kwargs(cfg: DictConfig) -> dict:
    """`prepare()`'s arguments from the composed config's `data` group (unset keys keep prepare's defaults)."""
    kwargs = {name: cfg.data[key] for key, name in ARGUMENTS.items() if cfg.data.get(key) is not None}
    if "input" in kwargs and not isinstance(kwargs["input"], str):
        kwargs["input"] = [str(v) for v in kwargs["input"]]
    return kwargs


def main(argv: list[str] | None = None) -> None:
    def task(cfg: DictConfig) -> int:
        try:
            prepare(**prepare_kwargs(cfg))
        except KeyboardInterrupt:
            print(
                "prepare: interrupted; nothing was moved into data.dir, and re-running the same command resumes",
                file=sys.stderr,
            )
            return 130
        return 0

    run_command("prepare", USAGE, task, argv, prog="python -m steadylm.data.prepare")


if __name__ == "__main__":
    main()
