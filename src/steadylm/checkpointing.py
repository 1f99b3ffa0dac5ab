"""Checkpoints that survive crashes and resume bitwise (docs/resume.md). Loads are `torch.load(weights_only=True)`:
pickled code is refused, never run."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import random
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from steadylm.errors import SteadyError
from steadylm.preemption import Preempted
from steadylm.sharded_save import SHARDED_META

log = logging.getLogger("steadylm")
STABILITY_STATE_KEY = "steadylm.stability"  # the stability callback's Lightning `state_key` in "callbacks"


class CheckpointError(SteadyError):
    """A checkpoint that cannot be used: missing, corrupt, unsafe, or for a different model."""


def is_complete(path: Path) -> bool:
    """`torch.save` writes a zip whose directory comes last: a truncated file fails to open, tensors unread. A
    distributed checkpoint (a folder): DCP writes `.metadata` once every rank's shards are in, then rank 0 `meta.pt`."""
    if path.is_dir():
        return (path / ".metadata").is_file() and is_complete(path / SHARDED_META)
    try:
        with zipfile.ZipFile(path) as z:
            return bool(z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def safe_load(path: str | os.PathLike, map_location: Any = "cpu", mmap: bool = False) -> dict:
    """`torch.load(weights_only=True)`, with each way it can fail turned into one clear message; a distributed
    checkpoint (a folder) is read whole (`load_sharded`)."""
    path = Path(path)
    if path.is_dir():
        return load_sharded(path, map_location)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint file not found; check ckpt_path (or use resume=auto)")
    if not is_complete(path):
        raise CheckpointError(
            f"{path}: not a complete checkpoint (truncated or corrupt); resume from another file in "
            f"{path.parent} (resume=auto picks the newest good one)"
        )
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        detail = str(e).split("\n\n")[1].strip() if "\n\n" in str(e) else str(e).splitlines()[0]
        raise CheckpointError(
            f"{path}: refused to load: it carries pickled code, which weights_only loading never runs ({detail}); "
            "resume only from checkpoints written by steadylm, or re-save this one's tensors from a trusted session"
        ) from None
    except (RuntimeError, OSError, EOFError) as e:
        raise CheckpointError(
            f"{path}: unreadable checkpoint ({type(e).__name__}: {e}); resume from another file"
        ) from None


def load_sharded(path: Path, map_location: Any = "cpu") -> dict:
    """A distributed checkpoint as a single-file one reads: the shards of every rank gathered into whole weights
    (torch's `dcp_to_torch_save`, through a temporary file beside it), the rest from its `meta.pt`; the optimizer
    state is left out. On one process, any number of ranks: what `generate`, `export`, `eval` and `init_from` read."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    if not is_complete(path):
        raise CheckpointError(
            f"{path}: not a complete distributed checkpoint (no .metadata or {SHARDED_META}: a save cut short); "
            f"resume from another one in {path.parent} (resume=auto picks the newest good one)"
        )
    meta = safe_load(path / SHARDED_META, map_location=map_location)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".consolidate-") as tmp:
        dcp_to_torch_save(path, Path(tmp) / "whole.pt")
        whole = safe_load(Path(tmp) / "whole.pt", map_location=map_location)
    return {**meta, "state_dict": whole["state_dict"]}


def describe_sharded(path: Path) -> dict:
    """A distributed checkpoint's `meta.pt`, with its `state_dict` as shapes only (meta tensors, from DCP's
    `.metadata`): enough to check a resume against the model without reading, let alone gathering, a weight."""
    from torch.distributed.checkpoint import FileSystemReader

    if not is_complete(path):
        load_sharded(path)  # its message
    shapes = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    weights = {k.removeprefix("state_dict."): v for k, v in shapes.items() if k.startswith("state_dict.")}
    state = {k: torch.empty(v.size, device="meta") for k, v in weights.items() if hasattr(v, "size")}
    return {**safe_load(path / SHARDED_META), "state_dict": state}


class AtomicCheckpointIO(TorchCheckpointIO):
    """A save goes to a hidden temp file, fsynced and renamed into place: a kill, a full disk or a power cut mid-save
    leaves `path` the old file or the complete new one. (Lightning's own save buffers it all in memory first.)"""

    def save_checkpoint(self, checkpoint: dict, path, storage_options: Any = None) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # no `*.ckpt` glob ever matches it
        try:
            with open(tmp, "wb") as f:
                torch.save(checkpoint, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        with contextlib.suppress(OSError):  # the rename itself made durable, where the platform allows
            fd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)

    def load_checkpoint(self, path, map_location: Any = lambda storage, loc: storage, weights_only=None) -> dict:
        return safe_load(path, map_location=map_location)


class SaveOnException(L.Callback):
    """Save `<dirpath>/exception.ckpt` when training (not setup or a failed restore) dies of an exception.
    Single-process only: under DDP the other ranks may be stuck in a collective, and a save is one."""

    def __init__(self, dirpath: str, filename: str = "exception.ckpt"):
        self.path, self._training = Path(dirpath) / filename, False

    def on_train_start(self, trainer, pl_module) -> None:
        self._training = True

    def on_train_end(self, trainer, pl_module) -> None:
        self._training = False

    def on_exception(self, trainer, pl_module, exception) -> None:
        if not self._training or trainer.world_size > 1 or isinstance(exception, Preempted):
            return  # (a preemption has already saved its own checkpoint)
        self._training, what = False, type(exception).__name__
        try:
            trainer.save_checkpoint(self.path)
        except Exception as err:  # never mask the exception that ended training
            log.error("%s: could not save on %s (%s)", self.path, what, err)
            return
        log.warning("%s: saved on %s at step %d; resume with resume=auto", self.path, what, trainer.global_step)


def rng_state() -> dict:
    """Every global RNG (torch, numpy, python, CUDA), in types a weights-only checkpoint can hold."""
    _, key, pos, has_gauss, gauss = np.random.get_state()  # numpy's key is kept as a tensor, not an ndarray
    numpy = {"key": torch.from_numpy(key.astype(np.int64)), "pos": int(pos), "has_gauss": has_gauss, "gauss": gauss}
    state = {"torch": torch.get_rng_state(), "numpy": numpy, "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    n, (version, internal, gauss) = state["numpy"], state["python"]
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", n["key"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RNGState(L.Callback):
    """Carry the global RNGs through checkpoints for a bitwise resume, set at `on_train_start`, after the resumed
    loaders are built (which draw from their own `torch.Generator`, as validation does: the stream never shifts)."""

    _pending: dict | None = None

    def state_dict(self) -> dict:
        return rng_state()

    def load_state_dict(self, state_dict: dict) -> None:
        self._pending = state_dict

    def on_train_start(self, trainer, pl_module) -> None:
        if self._pending is not None:
            set_rng_state(self._pending)
            self._pending = None
