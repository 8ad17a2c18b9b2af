"""Striped files for the checkpoint functions: a file object over a striped file (for
``deepnvme.load``'s zip structures) and the copies behind ``deepnvme volume join|split``.
``deepnvme.save`` to a volume is :func:`deepnvme.checkpoint.saver.save_striped`."""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ..config import IOConfig
from ..handles.aio import AioHandle
from ..io import durable
from ..io.volume import VolumePath
from ..io.volume_files import remove, rename, striped_size, temp_path
from ..memory.views import aligned_empty

__all__ = ["StripedReader", "join_file", "split_file"]


class StripedReader(io.RawIOBase):
    """A read-only, seekable file object over a striped file (for the zip's small structures:
    each ``readinto`` is one blocking read through ``handle``)."""

    def __init__(self, handle: AioHandle, vpath: VolumePath, size: int) -> None:
        super().__init__()
        self._handle, self._vpath, self._size, self._pos = handle, vpath, size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        if base + offset < 0:
            raise ValueError(f"negative seek position in {self._vpath}")
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = max(0, min(len(buffer), self._size - self._pos))
        if n:
            out = torch.frombuffer(memoryview(buffer).cast("B"), dtype=torch.uint8)[:n]
            self._handle.submit_read(out, self._vpath, offset=self._pos).result()
            self._pos += n
        return n


#: bytes per copy step of join/split (two such buffers are in flight)
COPY_BLOCK = 64 << 20


def join_file(vpath: VolumePath, dest: str, cfg: IOConfig) -> int:
    """Copy the striped file ``vpath`` into the plain file ``dest`` (replaced atomically and
    durably). Returns the byte count. Memory: two ``COPY_BLOCK`` buffers. Blocks."""
    size = striped_size(vpath)
    with durable.atomic_target(dest) as tmp, AioHandle(config=cfg) as handle:
        _copy(handle, size, lambda buf, off: handle.submit_read(buf, vpath, offset=off),
              lambda buf, off: handle.submit_write(buf, tmp, offset=off))
        if not size:
            open(tmp, "wb").close()
    return size


def split_file(src: str, vpath: VolumePath, cfg: IOConfig) -> int:
    """Copy the plain file ``src`` into the striped file ``vpath`` (written under a temporary
    name, then renamed over it). Returns the byte count. Blocks."""
    size = os.path.getsize(src)
    tmp = temp_path(vpath)
    try:
        with AioHandle(config=cfg) as handle:
            _copy(handle, size, lambda buf, off: handle.submit_read(buf, src, offset=off),
                  lambda buf, off: handle.submit_write(buf, tmp, offset=off, fsync=True))
            if not size:
                handle.submit_write(torch.empty(0, dtype=torch.uint8), tmp).result()
        rename(tmp, vpath)
    except BaseException:
        remove(tmp)
        raise
    return size


def _copy(handle: AioHandle, size: int, read: Callable[[torch.Tensor, int], Future[int]],
          write: Callable[[torch.Tensor, int], Future[int]]) -> None:
    """Copy ``size`` bytes block by block, reading the next block while one is written."""
    buffers = [aligned_empty(min(COPY_BLOCK, size), 0) for _ in range(2)] if size else []
    pending: Future[int] | None = None
    for i, off in enumerate(range(0, size, COPY_BLOCK)):
        buf = buffers[i % 2][:min(COPY_BLOCK, size - off)]
        read(buf, off).result()
        if pending is not None:
            pending.result()
        pending = write(buf, off)
    if pending is not None:
        pending.result()
