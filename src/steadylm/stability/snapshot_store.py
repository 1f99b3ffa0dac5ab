"""Where a snapshot's tensors live, never in the memory training runs in; both reuse their storage and are bitwise.

- `HostBuffers` (`store: memory`; `auto` on a GPU): pinned host buffers, copied `non_blocking` on the training stream.
- `SnapshotFile` (`store: disk`; `auto` on a CPU, where host memory *is* training memory): saved by a background
  thread during forward and backward, then synced and dropped from the page cache: it holds no RAM once on disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

STORES = ("auto", "memory", "disk")


class HostBuffers:
    kind = "memory"

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.event = None  # CUDA event recorded after the copies

    def write(self, tensors: list[torch.Tensor]) -> None:
        old, self.buffers = self.buffers, []
        for i, t in enumerate(tensors):
            reuse = i < len(old) and old[i].shape == t.shape and old[i].dtype == t.dtype
            self.buffers.append(old[i] if reuse else torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda))
            self.buffers[-1].copy_(t, non_blocking=True)
        self.event = torch.cuda.Event() if tensors and tensors[0].is_cuda else None
        if self.event is not None:
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def wait_written(self) -> None:
        """Nothing to wait for: stream order keeps the update behind the copies (on a CPU they are done)."""

    def held(self) -> list[torch.Tensor]:
        self.wait()
        return self.buffers

    def read(self, start: int = 0, stop: int | None = None, copy: bool = True) -> list[torch.Tensor]:
        """The host tensors `start:stop`; `copy`: fresh ones, which training may write into."""
        return [b.clone() if copy else b for b in self.held()[start:stop]]

    def close(self) -> None:
        """Nothing to remove: the buffers go with the snapshot."""


class SnapshotFile(HostBuffers):
    kind = "disk"

    def __init__(self, path: Path, flusher: ThreadPoolExecutor) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        self.path, self.flusher = path, flusher
        self.written = self.flushed = None  # futures: the bytes are in the file; ... and on disk, out of the page cache

    def write(self, tensors: list[torch.Tensor]) -> None:
        """Start saving `tensors` in the background (as a GPU's copy engine); `wait_written` before they change."""
        self.wait()
        hosts = [t.detach().to("cpu") for t in tensors]  # a copy only for GPU tensors
        self.written = self.flusher.submit(self._save, hosts)
        self.flushed = self.flusher.submit(self._flush)  # one worker: after the save

    def _save(self, hosts: list[torch.Tensor]) -> None:
        with open(self.path, "wb") as f:  # a file object: a full disk raises OSError (a path: RuntimeError)
            torch.save(hosts, f)

    def _flush(self) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages now: the snapshot leaves RAM
            finally:
                os.close(fd)
        except OSError as err:  # the bytes are still readable from the page cache; they just hold RAM
            log.warning("%s: syncing a snapshot file failed (%s); it stays in the page cache", self.path, err)

    def wait_written(self) -> None:
        """Block until the save has read every tensor: before anything changes the live ones (the update)."""
        written, self.written = self.written, None
        if written is not None:
            written.result()

    def wait(self) -> None:
        """The last save is on disk and out of the page cache (a failed save raises here, once)."""
        self.wait_written()
        flushed, self.flushed = self.flushed, None
        if flushed is not None:
            flushed.result()

    def held(self) -> list[torch.Tensor]:
        """The saved tensors, mapped from the file (a removed file raises OSError)."""
        self.wait()
        return torch.load(self.path, mmap=True, weights_only=True)

    def close(self) -> None:
        """Remove the file (its storage is not reused)."""
        with contextlib.suppress(OSError):  # a failed save no longer matters: the file goes
            self.wait()
        self.path.unlink(missing_ok=True)
