"""HDF5 token shards (format versions 1 and 2): write atomically, validate, open for random reads.

A shard is one `.h5` file with a 1-D unsigned-integer dataset `tokens` (documents separated by
`eos_id`) and attributes naming the tokenizer that produced it. Version 2 adds `n_bytes`, the UTF-8
bytes of the text behind the tokens (bits per byte needs it); readers accept both, writers write 2. This module is the only code
that knows the on-disk layout. It must never leave a partial file under a shard's name (writes
go to `*.h5.partial` and are renamed into place) and never let a bad shard reach training:
every problem becomes one `DataError` naming the file, the problem and the fix.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from steadylm.errors import DataError

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
DATASET = "tokens"
CHUNK_TOKENS = 64 * 1024
REQUIRED_ATTRS = ("format_version", "vocab_size", "eos_id", "tokenizer", "n_tokens", "max_token_id")

# Chunk cache for random windows. A chunk is 64Ki tokens = 128 KiB (uint16) or 256 KiB (uint32),
# so a window of T+1 <= 64Ki tokens touches at most two chunks. 16 MiB holds 64-128 chunks: enough
# that consecutive/nearby windows reuse chunks, small enough to keep per worker per open shard.
# HDF5 advises ~100x as many hash slots as cacheable chunks and a prime to spread the hash;
# 12_799 is prime (~100 x 128) and costs ~100 KiB, unlike a million slots (8 MiB of pointers).
RDCC_NBYTES = 16 * 1024 * 1024
RDCC_NSLOTS = 12_799
_SCAN_BLOCK = 1 << 22  # tokens per block when rescanning for max id (4Mi tokens, <= 16 MiB)


@dataclass(frozen=True)
class ShardInfo:
    path: Path
    n_tokens: int
    vocab_size: int
    eos_id: int
    tokenizer: str
    max_token_id: int
    dtype: str
    n_bytes: int | None = None  # format 2 only
    format_version: int = FORMAT_VERSION


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype(np.uint16) if int(vocab_size) <= 65536 else np.dtype(np.uint32)


def write_shard(
    path, tokens: np.ndarray, *, vocab_size: int, eos_id: int, tokenizer: str, n_bytes: int | None = None
) -> ShardInfo:
    """Write `tokens` to `path` atomically; on any failure nothing appears under `path`.

    With `n_bytes` the shard is format 2; without, format 1 (kept for tests of old shards).
    """
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
                f"{path}: token ids span {lo}..{hi} but vocab_size is {vocab_size}; "
                "the tokenizer and vocab_size disagree"
            )
        if not 0 <= eos_id < vocab_size:
            raise DataError(f"{path}: eos_id {eos_id} is outside vocab_size {vocab_size}")
        dtype = token_dtype(vocab_size)
        data = arr.astype(dtype, copy=False)
        version = 1 if n_bytes is None else 2
        with h5py.File(partial, "w") as f:
            ds = f.create_dataset(DATASET, shape=data.shape, dtype=dtype, chunks=(min(CHUNK_TOKENS, data.size),))
            f.attrs["vocab_size"] = int(vocab_size)
            f.attrs["eos_id"] = int(eos_id)
            f.attrs["tokenizer"] = str(tokenizer)
            ds[...] = data
            # Written last: a reader that sees them knows the data before them is complete.
            f.attrs["n_tokens"] = int(data.size)
            f.attrs["max_token_id"] = hi
            if n_bytes is not None:
                f.attrs["n_bytes"] = int(n_bytes)
            f.attrs["format_version"] = version
        os.replace(partial, path)
    except BaseException as e:
        try:
            partial.unlink()
        except FileNotFoundError:
            pass
        except OSError:
            pass
        if isinstance(e, DataError) or not isinstance(e, Exception):
            raise
        raise DataError(
            f"{path}: could not write shard ({type(e).__name__}: {e}); nothing was left behind, "
            "free disk space or fix the output folder and re-run prepare"
        ) from e
    return ShardInfo(
        path,
        int(data.size),
        int(vocab_size),
        int(eos_id),
        str(tokenizer),
        hi,
        dtype.name,
        None if n_bytes is None else int(n_bytes),
        version,
    )


def _attr(f: h5py.File, path: Path, name: str):
    if name not in f.attrs:
        raise DataError(
            f"{path}: missing attribute {name!r} (not a steadylm shard, or its write "
            "never finished); re-run `python -m steadylm.data.prepare`"
        )
    v = f.attrs[name]
    return v.decode() if isinstance(v, bytes) else v


PREPARE_HINT = "run `make data` or `python -m steadylm.data.prepare data.dir={dir}`"


def shard_files(data_dir: Path, split: str) -> list[Path]:
    """`data_dir/<split>-*.h5`, sorted; one DataError naming the folder and the command when there are none."""
    if not data_dir.is_dir():
        raise DataError(f"{data_dir}: data.dir does not exist; " + PREPARE_HINT.format(dir=data_dir))
    files = sorted(data_dir.glob(f"{split}-*.h5"))
    if not files:
        raise DataError(f"{data_dir}: no {split} shards ({split}-*.h5) found; " + PREPARE_HINT.format(dir=data_dir))
    return files


def read_shard_info(path, *, deep: bool = False, progress: bool = False) -> ShardInfo:
    """Validate a shard's structure and attributes; `deep=True` also rescans every token id."""
    path = Path(path)
    fix = "re-run `python -m steadylm.data.prepare` to rewrite it"
    if not path.exists():
        raise DataError(f"{path}: shard file not found; {fix}")
    if not path.is_file():
        raise DataError(f"{path}: is not a regular file; point data.dir at a folder of .h5 shards")
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise DataError(f"{path}: not a readable HDF5 file (truncated or corrupt: {e}); {fix}") from None
    try:
        with f:
            if DATASET not in f or not isinstance(f[DATASET], h5py.Dataset):
                raise DataError(f"{path}: has no {DATASET!r} dataset; {fix}")
            ds = f[DATASET]
            if ds.ndim != 1:
                raise DataError(f"{path}: {DATASET!r} has shape {ds.shape} but must be 1-D; {fix}")
            if ds.dtype.kind != "u":
                raise DataError(
                    f"{path}: {DATASET!r} has dtype {ds.dtype} but token ids must be unsigned integers; {fix}"
                )
            n = int(ds.shape[0])
            if n == 0:
                raise DataError(f"{path}: {DATASET!r} is empty (0 tokens); delete it or {fix}")
            version = _attr(f, path, "format_version")
            if int(version) not in READABLE_VERSIONS:
                raise DataError(
                    f"{path}: format_version {version} is not supported (this steadylm reads "
                    f"versions {', '.join(map(str, READABLE_VERSIONS))}); {fix}"
                )
            version = int(version)
            n_bytes = int(_attr(f, path, "n_bytes")) if version >= 2 else None
            vocab_size = int(_attr(f, path, "vocab_size"))
            eos_id = int(_attr(f, path, "eos_id"))
            tokenizer = str(_attr(f, path, "tokenizer"))
            n_tokens = int(_attr(f, path, "n_tokens"))
            max_id = int(_attr(f, path, "max_token_id"))
            if n_tokens != n:
                raise DataError(
                    f"{path}: attribute n_tokens={n_tokens} but {DATASET!r} holds {n} tokens (incomplete write?); {fix}"
                )
            if max_id >= vocab_size:
                raise DataError(
                    f"{path}: max_token_id {max_id} >= vocab_size {vocab_size} (out-of-vocabulary ids); {fix}"
                )
            if not 0 <= eos_id < vocab_size:
                raise DataError(f"{path}: eos_id {eos_id} is outside vocab_size {vocab_size}; {fix}")
            if ds.compression is not None:
                warnings.warn(
                    f"{path}: tokens are {ds.compression}-compressed; random windows will be slow to read "
                    "(prepare writes uncompressed shards)",
                    stacklevel=2,
                )
            if deep:
                real_max = scan_tokens(ds, path, vocab_size, "vocab_size", progress=progress)
                if real_max != max_id:
                    raise DataError(
                        f"{path}: attribute max_token_id={max_id} but the largest id stored is {real_max}; {fix}"
                    )
            dtype = ds.dtype.name
    except DataError:
        raise
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise DataError(f"{path}: unreadable shard ({type(e).__name__}: {e}); {fix}") from None
    return ShardInfo(path, n, vocab_size, eos_id, tokenizer, max_id, dtype, n_bytes, version)


def scan_tokens(ds, path, limit: int, what: str, *, progress: bool = False) -> int:
    """Read every id of `ds` in blocks; the first id >= `limit` is one `DataError` naming file, offset and id.

    Returns the largest id. `what` names the bound (`vocab_size`, `model.vocab_size`) in the message.
    """
    n = int(ds.shape[0])
    real_max = 0
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=n, desc=f"scan {Path(path).name}", unit="tok", unit_scale=True, leave=False, dynamic_ncols=True
        )
    try:
        for start in range(0, n, _SCAN_BLOCK):
            try:
                block = ds[start : start + _SCAN_BLOCK]
            except (OSError, ValueError) as e:
                raise DataError(
                    f"{path}: unreadable tokens at offset {start} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                    "re-run `python -m steadylm.data.prepare` to rewrite it"
                ) from None
            m = int(block.max())
            if m >= limit:
                off = start + int(np.argmax(block >= limit))
                raise DataError(
                    f"{path}: token id {int(block[off - start])} at token offset {off} is >= {what} {limit} "
                    "(out-of-vocabulary id); re-run `python -m steadylm.data.prepare` to rewrite it"
                )
            real_max = max(real_max, m)
            if bar is not None:
                bar.update(block.size)
    finally:
        if bar is not None:
            bar.close()
    return real_max


def open_tokens(path) -> h5py.Dataset:
    """Open a shard's `tokens` read-only with a chunk cache sized for random windows.

    The returned dataset keeps its file open; call `.file.close()` (or drop it) when done.
    Anything that is not a 1-D unsigned-integer `tokens` dataset is one `DataError` naming the file.
    """
    fix = "re-run `python -m steadylm.data.prepare` to rewrite it"
    try:
        f = h5py.File(path, "r", rdcc_nbytes=RDCC_NBYTES, rdcc_nslots=RDCC_NSLOTS)
    except OSError as e:
        raise DataError(f"{path}: not a readable HDF5 file (truncated or corrupt: {e}); {fix}") from None
    try:
        ds = f[DATASET]
        if not isinstance(ds, h5py.Dataset) or ds.ndim != 1 or ds.dtype.kind != "u":
            raise DataError(
                f"{path}: {DATASET!r} is not a 1-D unsigned-integer dataset "
                f"({getattr(ds, 'dtype', type(ds).__name__)}); {fix}"
            )
        return ds
    except KeyError:
        f.close()
        raise DataError(f"{path}: has no {DATASET!r} dataset; {fix}") from None
    except DataError:
        f.close()
        raise
