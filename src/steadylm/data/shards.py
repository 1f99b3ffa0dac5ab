"""HDF5 token shards (format 1, and 2 with `n_bytes`) as prepare writes them: validated, opened for random reads.

A shard is a 1-D unsigned-integer `tokens` (documents separated by `eos_id`) plus attributes; a bad one is one
`DataError` naming the file, the problem and the fix."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np

from steadylm.errors import DataError

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
DATASET = "tokens"
# A window of T+1 <= 64Ki tokens touches at most two 128-256 KiB chunks; 16 MiB keeps nearby windows' chunks per
# worker per shard. HDF5 advises ~100x as many hash slots as chunks, prime.
RDCC_NBYTES = 16 * 1024 * 1024
RDCC_NSLOTS = 12_799
_SCAN_BLOCK = 1 << 22  # tokens per block when rescanning for max id (<= 16 MiB)
REWRITE = "re-run `python -m steadylm.data.prepare` to rewrite it"


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


def _attr(f: h5py.File, path: Path, name: str):
    if name not in f.attrs:
        raise DataError(
            f"{path}: missing attribute {name!r} (not a steadylm shard, or its write "
            "never finished); re-run `python -m steadylm.data.prepare`"
        )
    v = f.attrs[name]
    return v.decode() if isinstance(v, bytes) else v


def read_shard_info(path, *, deep: bool = False, progress: bool = False) -> ShardInfo:
    """Validate a shard's structure and attributes; `deep=True` also rescans every token id."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: shard file not found; {REWRITE}")
    if not path.is_file():
        raise DataError(f"{path}: is not a regular file; point data.dir at a folder of .h5 shards")
    try:
        ds = open_tokens(path)
        with ds.file as f:
            if (n := int(ds.shape[0])) == 0:
                raise DataError(f"{path}: {DATASET!r} is empty (0 tokens); delete it or {REWRITE}")
            version = _attr(f, path, "format_version")
            if int(version) not in READABLE_VERSIONS:
                raise DataError(
                    f"{path}: format_version {version} is not supported (this steadylm reads "
                    f"versions {', '.join(map(str, READABLE_VERSIONS))}); {REWRITE}"
                )
            n_bytes = int(_attr(f, path, "n_bytes")) if int(version) >= 2 else None
            vocab_size, eos_id = int(_attr(f, path, "vocab_size")), int(_attr(f, path, "eos_id"))
            tokenizer, n_tokens = str(_attr(f, path, "tokenizer")), int(_attr(f, path, "n_tokens"))
            max_id = int(_attr(f, path, "max_token_id"))
            for bad, problem in (
                (n_tokens != n, f"attribute n_tokens={n_tokens} but {DATASET!r} holds {n} tokens (incomplete write?)"),
                (max_id >= vocab_size, f"max_token_id {max_id} >= vocab_size {vocab_size} (out-of-vocabulary ids)"),
                (not 0 <= eos_id < vocab_size, f"eos_id {eos_id} is outside vocab_size {vocab_size}"),
            ):
                if bad:
                    raise DataError(f"{path}: {problem}; {REWRITE}")
            if ds.compression is not None:
                warnings.warn(
                    f"{path}: tokens are {ds.compression}-compressed; random windows will be slow to read "
                    "(prepare writes uncompressed shards)",
                    stacklevel=2,
                )
            if deep and (real_max := scan_tokens(ds, path, vocab_size, progress=progress)) != max_id:
                raise DataError(
                    f"{path}: attribute max_token_id={max_id} but the largest id stored is {real_max}; {REWRITE}"
                )
            return ShardInfo(path, n, vocab_size, eos_id, tokenizer, max_id, ds.dtype.name, n_bytes, int(version))
    except (OSError, KeyError, ValueError, TypeError) as e:
        raise DataError(f"{path}: unreadable shard ({type(e).__name__}: {e}); {REWRITE}") from None


def scan_tokens(ds, path, vocab_size: int, *, progress: bool = False) -> int:
    """The largest id of `ds`, read in blocks; the first id >= `vocab_size` is one `DataError` naming its offset."""
    from tqdm import tqdm

    n, real_max = int(ds.shape[0]), 0
    look = {"unit": "tok", "unit_scale": True, "leave": False, "dynamic_ncols": True, "disable": not progress}
    with tqdm(total=n, desc=f"scan {Path(path).name}", **look) as bar:
        for start in range(0, n, _SCAN_BLOCK):
            try:
                block = ds[start : start + _SCAN_BLOCK]
            except (OSError, ValueError) as e:
                raise DataError(
                    f"{path}: unreadable tokens at offset {start} ({type(e).__name__}: {str(e).splitlines()[0]}); "
                    + REWRITE
                ) from None
            if (m := int(block.max())) >= vocab_size:
                off = int(np.argmax(block >= vocab_size))
                raise DataError(
                    f"{path}: token id {int(block[off])} at token offset {start + off} is >= vocab_size {vocab_size} "
                    f"(out-of-vocabulary id); {REWRITE}"
                )
            real_max = max(real_max, m)
            bar.update(block.size)
    return real_max


def open_tokens(path) -> h5py.Dataset:
    """A shard's `tokens`, read-only, with a chunk cache sized for random windows; close with `.file.close()`.
    Anything but a 1-D unsigned-integer `tokens` dataset is one `DataError` naming the file."""
    try:
        f = h5py.File(path, "r", rdcc_nbytes=RDCC_NBYTES, rdcc_nslots=RDCC_NSLOTS)
    except OSError as e:
        raise DataError(f"{path}: not a readable HDF5 file (truncated or corrupt: {e}); {REWRITE}") from None
    ds = f.get(DATASET)
    if isinstance(ds, h5py.Dataset) and ds.ndim == 1 and ds.dtype.kind == "u":
        return ds
    problem = (
        f"{DATASET!r} is not a 1-D unsigned-integer dataset (shape {ds.shape}, dtype {ds.dtype}): it must be 1-D "
        "and token ids must be unsigned integers"
        if isinstance(ds, h5py.Dataset)
        else f"has no {DATASET!r} dataset"
    )
    f.close()
    raise DataError(f"{path}: {problem}; {REWRITE}")
