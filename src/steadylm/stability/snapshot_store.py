"""Where a snapshot's tensors live, never in the memory training runs in; both reuse their storage and are bitwise.

- `HostBuffers` (`store: memory`; `auto` on a GPU): pinned host buffers, copied `non_blocking` on the training stream.
- `SnapshotFile` (`store: disk`; `auto` on a CPU, where host memory *is* training memory): written by a background
  thread during forward and backward, then synced and dropped from the page cache: it holds no RAM once on disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

log = logging.getLogger(__name__)

STORES = ("auto", "memory", "disk")


def _bytes(t: torch.Tensor):
    """A writable byte view (numpy) of a contiguous CPU tensor's storage."""
    return t.reshape(-1).view(torch.uint8).numpy()


class HostBuffers:
    kind = "memory"

    def __init__(self) -> None:
        self.buffers: list[torch.Tensor] = []
        self.event = None  # CUDA event recorded after the copies

    def write(self, tensors: list[torch.Tensor]) -> None:
        old, self.buffers = self.buffers, []
        for i, t in enumerate(tensors):
            reuse = i < len(old) and old[i].shape == t.shape and old[i].dtype == t.dtype
            buf = old[i] if reuse else torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            buf.copy_(t, non_blocking=True)
            self.buffers.append(buf)
        self.event = torch.cuda.Event() if tensors and tensors[0].is_cuda else None
        if self.event is not None:
            self.event.record()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()
            self.event = None

    def wait_written(self) -> None:
        """Nothing to wait for: stream order keeps the update behind the copies (on a CPU they are done)."""

    def read(self, start: int = 0, stop: int | None = None, copy: bool = True) -> list[torch.Tensor]:
        """The host tensors `start:stop`; `copy`: fresh ones, which training may write into."""
        self.wait()
        return [b.clone() if copy else b for b in self.buffers[start:stop]]

    def read_into(self, live: list[torch.Tensor]) -> None:
        self.wait()
        for t, b in zip(live, self.buffers):
            t.copy_(b)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)

    def close(self) -> None:
        """Nothing to remove: the buffers go with the snapshot."""


class SnapshotFile:
    kind = "disk"

    def __init__(self, path: Path, flusher: ThreadPoolExecutor) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path, self.flusher = path, flusher
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        self.layout: list[tuple[torch.Size, torch.dtype, int, int]] = []  # shape, dtype, offset, bytes
        self.written: Future | None = None  # the bytes are in the file (the live tensors may change again)
        self.flushed: Future | None = None  # ... and on disk, out of the page cache

    def wait_written(self) -> None:
        """Block until the write has read every tensor: before anything changes the live ones (the update)."""
        written, self.written = self.written, None
        if written is not None:
            written.result()

    def _readable(self) -> None:
        if self.fd < 0:
            raise OSError(f"{self.path}: this snapshot's file was removed at the end of the fit")
        self.wait_written()

    def wait(self) -> None:
        """The last write is on disk and out of the page cache (a failed write raises here)."""
        self._readable()
        flushed, self.flushed = self.flushed, None
        if flushed is not None:
            flushed.result()

    def write(self, tensors: list[torch.Tensor]) -> None:
        """Start writing `tensors` in the background (as a GPU's copy engine); `wait_written` before they change."""
        self.wait()
        hosts = [t.detach().to("cpu").contiguous() for t in tensors]  # a copy only for GPU or strided tensors
        self.layout, offset = [], 0
        for h in hosts:
            self.layout.append((h.shape, h.dtype, offset, h.numel() * h.element_size()))
            offset += self.layout[-1][3]
        self.written = self.flusher.submit(self._write, hosts)
        self.flushed = self.flusher.submit(self._flush, self.fd)  # one worker: after the write

    def _write(self, hosts: list[torch.Tensor]) -> None:
        for h, (_, _, offset, n) in zip(hosts, self.layout):
            view, done = _bytes(h), 0
            while done < n:  # one pwrite moves at most ~2 GB
                done += os.pwrite(self.fd, view[done:], offset + done)
        os.ftruncate(self.fd, self.nbytes())

    def _flush(self, fd: int) -> None:
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # clean pages now: the snapshot leaves RAM
        except OSError as err:  # the bytes are still readable from the page cache; they just hold RAM
            log.warning("%s: syncing a snapshot file failed (%s); it stays in the page cache", self.path, err)

    def _read_into(self, t: torch.Tensor, i: int) -> None:
        if t.device.type != "cpu" or not t.is_contiguous():
            host = torch.empty(t.shape, dtype=t.dtype)
            self._read_into(host, i)
            t.copy_(host)
            return
        _, _, offset, n = self.layout[i]
        view, done = _bytes(t), 0
        while done < n:
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise OSError(f"{self.path}: snapshot file ends early at byte {offset + done}")
            done += got

    def read(self, start: int = 0, stop: int | None = None, copy: bool = True) -> list[torch.Tensor]:
        """The tensors `start:stop`, read from the file (always fresh ones)."""
        self._readable()
        out = [torch.empty(shape, dtype=dtype) for shape, dtype, _, _ in self.layout[start:stop]]
        for i, t in enumerate(out, start):
            self._read_into(t, i)
        return out

    def read_into(self, live: list[torch.Tensor]) -> None:
        self._readable()
        for i, t in enumerate(live):
            self._read_into(t, i)

    def nbytes(self) -> int:
        return sum(n for *_, n in self.layout)

    def close(self) -> None:
        """Remove the file (its storage is not reused)."""
        if self.fd < 0:
            return
        with contextlib.suppress(OSError):  # a failed write no longer matters: the file goes
            for pending in (self.written, self.flushed):
                if pending is not None:
                    pending.result()
        os.close(self.fd)
        self.fd, self.written, self.flushed = -1, None, None
        self.path.unlink(missing_ok=True)
