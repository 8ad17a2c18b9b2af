"""``deepnvme.save``/``load`` of one torch.save file striped over a volume.

The zip is PyTorch's own: its skeleton (``skip_data``) is written to a temporary plain file on
the volume's first drive, then the skeleton's headers and every storage's bytes, straight from
tensor memory, go to a temporary striped file in one batch over all drives, which then replaces
the target (:func:`deepnvme.io.volume_files.rename`). Loading reads the small zip structures
through :class:`StripedReader` and every storage record in parallel, as for a plain file.
"""

from __future__ import annotations

import io
import os
import secrets
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ..config import IOConfig
from ..formats.torchzip import RecordSpan
from ..handles.aio import AioHandle
from ..io import durable
from ..io.file import read_buffered
from ..io.volume import VolumePath
from ..io.volume_files import remove, rename, striped_size
from ..memory.views import aligned_empty, storage_bytes
from .saver import StorageLayout, write_skeleton

__all__ = ["save_striped", "StripedReader", "file_items", "join_file", "split_file"]


def save_striped(obj: object, vpath: VolumePath, cfg: IOConfig) -> None:
    """Save ``obj`` as a striped torch.save file at ``vpath``; blocks until it is durable."""
    first = os.path.join(vpath.volume.paths[0], os.path.dirname(vpath.name))
    os.makedirs(first, exist_ok=True)
    skeleton = durable.create_temp(first, os.path.basename(vpath.name) + ".skeleton")
    tmp = VolumePath(vpath.volume,
                     f"{vpath.name}.deepnvme-tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        layout = write_skeleton(obj, skeleton)
        items = file_items(skeleton, layout)
        with AioHandle(config=cfg) as handle:
            handle.write_many(tmp, items, fsync=True).result()
        rename(tmp, vpath)
    except BaseException:
        remove(tmp)
        raise
    finally:
        durable.remove_quietly(skeleton)


def file_items(skeleton: str, layout: StorageLayout) -> list[tuple[torch.Tensor, int]]:
    """Every byte of the file as (buffer, offset) items: the skeleton's header regions between
    the storage records (read now) and each storage's own memory."""
    size = os.path.getsize(skeleton)
    spans = sorted(((span, storage) for storage, span in layout.items.values()),
                   key=lambda item: item[0].offset)
    items: list[tuple[torch.Tensor, int]] = []
    pos = 0
    for span, storage in spans + [(RecordSpan(name="", offset=size, size=0), None)]:
        if span.offset > pos:
            region = aligned_empty(span.offset - pos, pos)
            read_buffered(skeleton, region, pos)
            items.append((region, pos))
        if storage is not None and span.size:
            items.append((storage_bytes(storage), span.offset))
        pos = max(pos, span.offset + span.size)
    return items


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
    tmp = VolumePath(vpath.volume,
                     f"{vpath.name}.deepnvme-tmp-{os.getpid()}-{secrets.token_hex(4)}")
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
