"""Input readers for `prepare`: `data.input` -> work units -> documents, streamed, never a whole file at once.

Inputs are files, folders and globs mixing plain text (`.txt` and any other suffix: `.md`, `.py`, ...; one
document per file), `.jsonl`, `.jsonl.gz`,
`.jsonl.zst` (one document per line, field `data.text_field`), `.parquet` (column `data.text_field`,
read one row group at a time with `pyarrow`), a Hugging Face `save_to_disk` folder (its Arrow files read
batch by batch with `pyarrow`), and `hf:NAME[:CONFIG][@SPLIT]` (a dataset streamed through `datasets`: a hub
name, needing network, or a local dataset folder; e.g. `hf:allenai/c4:en`, split `train` unless named).

A work unit is a piece of input one process reads alone (a group of small files, a byte range of a
`.jsonl`, a parquet row group, an Arrow file, a batch of documents read elsewhere). Units depend only on
the input, never on the number of processes, and reading them in order gives the documents in input
order, so the shards come out byte-identical whatever `data.num_proc` is.

A bad record (missing field, not UTF-8, binary, invalid JSON, corrupt compressed stream) is one
`DataError` naming the file and line/row; with `on_bad_record="skip"` it is counted in `stats` instead.
This module must never hold more than one read block (a few MB) of a file in memory.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from steadylm.errors import DataError

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")  # read as records; any other file is plain text
UNIT_BYTES = 8 << 20  # target input bytes per work unit
PIECE_BYTES = 8 << 20  # a large .txt document is read (and encoded) in pieces of about this size
HF_PREFIX = "hf:"


def kind_of(path: Path) -> str | None:
    """The reader for a path: a suffix from SUFFIXES, `arrow` for a `save_to_disk` folder, None for another folder,
    `txt` for any other file (a file that is not UTF-8 text is then a bad record naming it)."""
    if path.is_dir():
        return "arrow" if _arrow_files(path, probe=True) else None
    name = path.name.lower()
    for suffix in sorted(SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return suffix[1:]
    return "txt"


def _arrow_files(folder: Path, probe: bool = False) -> list[Path]:
    """The Arrow files of a `datasets` `save_to_disk` folder (a Dataset, or a DatasetDict's `train` split
    or else all its splits in listed order)."""
    if (folder / "dataset_dict.json").is_file():
        try:
            splits = json.loads((folder / "dataset_dict.json").read_text())["splits"]
        except (OSError, ValueError, KeyError, TypeError):
            raise DataError(
                f"{folder / 'dataset_dict.json'}: unreadable dataset_dict.json; re-save the dataset"
            ) from None
        splits = ["train"] if "train" in splits else list(splits)
        return [f for s in splits for f in _arrow_files(folder / s, probe)]
    state = folder / "state.json"
    if not state.is_file():
        return []
    if probe:
        return [state]
    try:
        names = [d["filename"] for d in json.loads(state.read_text())["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        raise DataError(
            f"{state}: unreadable state.json (not a `datasets` save_to_disk folder?); re-save the dataset"
        ) from None
    return [folder / n for n in names]


def resolve_inputs(input) -> list[tuple[str, Path | str]]:
    """A path, glob, folder, `hf:NAME[:CONFIG][@SPLIT]`, or a list of them -> [(kind, path)] in a stable order."""
    items = [input] if isinstance(input, (str, os.PathLike)) else list(input)
    out: list[tuple[str, Path | str]] = []
    for item in items:
        s = str(item)
        if s.startswith(HF_PREFIX):
            out.append(("hub", s[len(HF_PREFIX) :]))
            continue
        if glob.has_magic(s):
            matches = [Path(m) for m in sorted(glob.glob(os.path.expanduser(s), recursive=True))]
            matches = [m for m in matches if m.is_file() or kind_of(m) == "arrow"]
            if not matches:
                raise DataError(f"{s}: data.input pattern matches no files; check the path")
        else:
            p = Path(s).expanduser()
            if p.is_dir() and kind_of(p) != "arrow":
                files = (q for q in p.rglob("*") if q.is_file())  # less the hidden: .git/, .DS_Store
                matches = sorted(q for q in files if not any(x.startswith(".") for x in q.relative_to(p).parts))
                if not matches:
                    raise DataError(f"{p}: data.input folder holds no files (hidden ones are skipped)")
            elif p.exists():
                matches = [p]
            else:
                raise DataError(f"{p}: data.input file not found; check the path")
        for m in matches:
            kind = kind_of(m)
            if kind == "arrow":
                out.extend(("arrow", f) for f in _arrow_files(m))
            else:
                out.append((kind, m))
    if not out:
        raise DataError("data.input is an empty list; give at least one file, folder or glob")
    return out


@dataclass(frozen=True)
class Unit:
    kind: str  # txt | jsonl | jsonl.gz | jsonl.zst | parquet | arrow | docs
    paths: tuple[str, ...] = ()
    start: int = 0  # jsonl: byte range [start, end); parquet: row groups [start, end)
    end: int = 0
    texts: tuple[tuple[str, bool], ...] = ()  # docs: (text, ends_document) pairs read elsewhere
    nbytes: int = 0  # input bytes, for progress


def plan_units(inputs: list[tuple[str, Path | str]], text_field: str = "text") -> Iterator[Unit]:
    """Cut the inputs into work units of about UNIT_BYTES, in input order (hub datasets: batches of documents)."""
    group: list[str] = []
    group_bytes = 0
    for kind, path in inputs:
        if kind != "txt" and group:
            yield Unit("txt", tuple(group), nbytes=group_bytes)
            group, group_bytes = [], 0
        if kind == "hub":
            yield from doc_units(_hub_documents(str(path), text_field))
            continue
        size = _size(path)
        if kind == "txt":
            group.append(str(path))
            group_bytes += size
            if group_bytes >= UNIT_BYTES:
                yield Unit("txt", tuple(group), nbytes=group_bytes)
                group, group_bytes = [], 0
        elif kind == "jsonl":
            for start in range(0, max(size, 1), UNIT_BYTES):
                yield Unit(
                    kind, (str(path),), start, min(start + UNIT_BYTES, size), nbytes=min(UNIT_BYTES, size - start)
                )
        elif kind == "parquet":
            pf = _parquet(path)
            n = pf.metadata.num_row_groups
            if n == 0:
                yield Unit(kind, (str(path),), 0, 0, nbytes=size)
            per = [pf.metadata.row_group(i).total_byte_size for i in range(n)]
            i = 0
            while i < n:  # several small row groups per unit
                j, b = i, 0
                while j < n and (j == i or b + per[j] <= UNIT_BYTES):
                    b += per[j]
                    j += 1
                yield Unit(kind, (str(path),), i, j, nbytes=int(size * b / max(sum(per), 1)))
                i = j
        else:  # compressed jsonl and Arrow files: read whole, in order
            yield Unit(kind, (str(path),), nbytes=size)
    if group:
        yield Unit("txt", tuple(group), nbytes=group_bytes)


def doc_units(pieces) -> Iterator[Unit]:
    """Batch `(text, ends_document)` pairs read elsewhere into `docs` units."""
    batch, b = [], 0
    for text, end in pieces:
        batch.append((text, end))
        b += len(text)
        if b >= UNIT_BYTES:
            yield Unit("docs", texts=tuple(batch), nbytes=b)
            batch, b = [], 0
    if batch:
        yield Unit("docs", texts=tuple(batch), nbytes=b)


def _size(path) -> int:
    try:
        return os.path.getsize(path)
    except OSError as e:
        raise DataError(
            f"{path}: cannot read input file ({e.strerror or e}); check it exists and is readable"
        ) from None


def _parquet(path):
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid, OSError, ...
        raise DataError(
            f"{path}: not a readable parquet file ({type(e).__name__}: {str(e).splitlines()[0]}); check the file"
        ) from None


def hub_spec(spec: str) -> tuple[str, str | None, str]:
    """`NAME[:CONFIG][@SPLIT]` (what follows `hf:`) -> (name, config or None, split, `train` by default)."""
    rest, _, split = spec.partition("@")
    name, _, config = rest.partition(":")
    return name, config or None, split or "train"


def _hub_documents(spec: str, text_field: str) -> Iterator[tuple[str, bool]]:
    from steadylm.data.stream import open_stream, texts_of  # the one place that opens and reads a `datasets` stream

    rows = open_stream(*hub_spec(spec), where=f"hf:{spec}")
    try:
        for text in texts_of(rows, text_field):
            yield text, True
    except DataError as err:
        raise DataError(f"hf:{spec}: {err}") from None


# --- reading one unit ------------------------------------------------------------------------------------


@dataclass
class ReadStats:
    skipped: int = 0
    first_skip: str | None = None
    docs_read: int = 0
    samples: list = field(default_factory=list)


class _Reader:
    """Reads one unit; `bad()` raises or counts, following `on_bad_record`."""

    def __init__(self, text_field: str, lenient: bool, skip: bool, stats: ReadStats):
        self.field, self.lenient, self.skip, self.stats = text_field, lenient, skip, stats
        self.errors = "replace" if lenient else "strict"

    def bad(self, message: str) -> None:
        if not self.skip:
            raise DataError(message + "; fix the input or set data.on_bad_record=skip")
        self.stats.skipped += 1
        self.stats.first_skip = self.stats.first_skip or message

    def text_of(self, obj, where: str) -> str | None:
        value = obj.get(self.field) if isinstance(obj, dict) else None
        if not isinstance(value, str):
            self.bad(f"{where}: no string field {self.field!r} (data.text_field)")
            return None
        return value

    # .txt: one document per file, read in pieces cut after a newline ----------------------------------
    def _open(self, path: str):
        """The file opened for binary reading, or None after reporting it as a bad record."""
        try:
            return open(path, "rb")
        except OSError as e:
            self.bad(f"{path}: cannot read input file ({e.strerror or e})")
            return None

    def txt(self, path: str) -> Iterator[tuple[str, bool]]:
        f = self._open(path)
        if f is None:
            return
        with f:
            offset, carry, emitted, failed = 0, b"", False, False
            while True:
                try:
                    block = f.read(PIECE_BYTES)
                except OSError as e:
                    self.bad(f"{path}: read failed at byte {offset} ({e.strerror or e})")
                    failed = True
                    break
                data, last = carry + block, len(block) < PIECE_BYTES
                if last:
                    piece, carry = data, b""
                else:
                    cut = data.rfind(b"\n") + 1 or _utf8_boundary(data)
                    piece, carry = data[:cut], data[cut:]
                if piece:
                    text = self._decode(path, piece, offset)
                    if text is None:
                        failed = True
                        break
                    offset += len(piece)
                    emitted = True
                    yield text, False
                if last:
                    break
            if not emitted and not failed and not self.lenient:
                self.bad(f"{path}: input file is empty")
                return
            if failed and not emitted:
                return
        yield "", True

    def _decode(self, path: str, raw: bytes, offset: int) -> str | None:
        if not self.lenient:
            nul = raw.find(b"\x00")
            if nul >= 0:
                self.bad(f"{path}: looks binary (NUL byte at byte {offset + nul}), not UTF-8 text")
                return None
        try:
            return raw.decode("utf-8", errors=self.errors)
        except UnicodeDecodeError as e:
            self.bad(f"{path}: is not UTF-8 text ({e.reason} at byte {offset + e.start}); convert it to UTF-8")
            return None

    # .jsonl and compressed .jsonl ------------------------------------------------------------------
    def jsonl(self, unit: Unit) -> Iterator[tuple[str, bool]]:
        path = unit.paths[0]
        raw = self._open(path)
        if raw is None:
            return
        with raw:
            if unit.kind == "jsonl":
                if unit.start == 0 and unit.end == 0 and not self.lenient:
                    self.bad(f"{path}: input file is empty")
                    return
                stream = raw
                if unit.start > 0:  # a line belongs to the unit holding its first byte
                    raw.seek(unit.start - 1)
                    raw.readline()
                pos, limit = raw.tell(), unit.end
            elif unit.kind == "jsonl.gz":
                stream, pos, limit = gzip.GzipFile(fileobj=raw), 0, None
            else:
                import zstandard

                stream = io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), buffer_size=1 << 20)
                pos, limit = 0, None
            lineno = None if unit.kind == "jsonl" and unit.start > 0 else 0
            records = 0
            while limit is None or pos < limit:
                try:
                    line = stream.readline()
                except (OSError, EOFError, zlib.error, ValueError) as e:
                    self.bad(
                        f"{path}: corrupt compressed stream after line {records} "
                        f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'truncated'})"
                    )
                    return
                except Exception as e:  # zstandard.ZstdError
                    if type(e).__name__ != "ZstdError":
                        raise
                    self.bad(f"{path}: corrupt compressed stream after line {records} (ZstdError: {e})")
                    return
                if not line:
                    break
                start, pos = pos, pos + len(line)
                if lineno is not None:
                    lineno += 1
                records += 1
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except UnicodeDecodeError as e:
                    self.bad(f"{path}:{lineno or _line_at(path, start)}: is not UTF-8 text ({e.reason})")
                    continue
                except ValueError as e:
                    self.bad(
                        f"{path}:{lineno or _line_at(path, start)}: invalid JSON ({e}); each line must be one JSON object"
                    )
                    continue
                text = obj.get(self.field) if type(obj) is dict else None
                if type(text) is str:
                    yield text, True
                else:  # the line number only when it is needed: counting it costs a read of the file so far
                    self.text_of(obj, f"{path}:{lineno or _line_at(path, start)}")
            if records == 0 and unit.kind != "jsonl" and not self.lenient:
                self.bad(f"{path}: input file holds no records")

    # parquet and Arrow -----------------------------------------------------------------------------
    def parquet(self, unit: Unit) -> Iterator[tuple[str, bool]]:
        path = unit.paths[0]
        pf = _parquet(path)
        if self.field not in pf.schema_arrow.names:
            self.bad(
                f"{path}: no column {self.field!r} (data.text_field); columns are {', '.join(pf.schema_arrow.names)}"
            )
            return
        row = sum(pf.metadata.row_group(i).num_rows for i in range(unit.start))
        for rg in range(unit.start, unit.end):
            try:
                batches = pf.iter_batches(batch_size=4096, row_groups=[rg], columns=[self.field])
                for batch in batches:
                    yield from self._column(path, batch.column(0), row, "row")
                    row += batch.num_rows
            except DataError:
                raise
            except Exception as e:  # pyarrow: corrupt pages, bad types
                self.bad(f"{path}: row group {rg} unreadable ({type(e).__name__}: {str(e).splitlines()[0]})")
                return

    def arrow(self, unit: Unit) -> Iterator[tuple[str, bool]]:
        import pyarrow as pa

        path = unit.paths[0]
        try:
            reader = pa.ipc.open_stream(pa.memory_map(path, "r"))
        except Exception as e:
            self.bad(f"{path}: not a readable Arrow file ({type(e).__name__}: {str(e).splitlines()[0]})")
            return
        if self.field not in reader.schema.names:
            self.bad(
                f"{path}: no column {self.field!r} (data.text_field); columns are {', '.join(reader.schema.names)}"
            )
            return
        col, row = reader.schema.get_field_index(self.field), 0
        try:
            for batch in reader:
                yield from self._column(path, batch.column(col), row, "row")
                row += batch.num_rows
        except DataError:
            raise
        except Exception as e:
            self.bad(f"{path}: unreadable after row {row} ({type(e).__name__}: {str(e).splitlines()[0]})")

    def _column(self, path, column, first_row: int, what: str) -> Iterator[tuple[str, bool]]:
        for i, value in enumerate(column.to_pylist()):
            if not isinstance(value, str):
                self.bad(
                    f"{path}: {what} {first_row + i}: field {self.field!r} is {type(value).__name__}, not a string"
                )
                continue
            yield value, True

    def docs(self, unit: Unit) -> Iterator[tuple[str, bool]]:
        yield from unit.texts


def _utf8_boundary(data: bytes) -> int:
    """A cut position that does not split a UTF-8 sequence (no newline in a whole piece)."""
    cut = len(data)
    while cut > 0 and (data[cut - 1] & 0xC0) == 0x80:
        cut -= 1
    if cut > 0 and data[cut - 1] >= 0xC0:
        cut -= 1
    return cut or len(data)


def _line_at(path: str, offset: int) -> int:
    """1-based line number of the line starting at byte `offset` (only computed for an error message)."""
    n = 0
    with open(path, "rb") as f:
        left = offset
        while left > 0:
            block = f.read(min(left, 1 << 24))
            if not block:
                break
            n += block.count(b"\n")
            left -= len(block)
    return n + 1


def read_unit(
    unit: Unit, *, text_field: str = "text", lenient: bool = False, skip: bool = False, stats: ReadStats | None = None
) -> Iterator[tuple[str, bool]]:
    """Yield `(text, ends_document)` for a unit, in order; a long `.txt` comes in several pieces."""
    r = _Reader(text_field, lenient, skip, stats if stats is not None else ReadStats())
    if unit.kind == "txt":
        for path in unit.paths:
            yield from r.txt(path)
    elif unit.kind.startswith("jsonl"):
        yield from r.jsonl(unit)
    elif unit.kind == "parquet":
        yield from r.parquet(unit)
    elif unit.kind == "arrow":
        yield from r.arrow(unit)
    elif unit.kind == "docs":
        yield from r.docs(unit)
    else:
        raise ValueError(f"unknown unit kind {unit.kind!r}")
