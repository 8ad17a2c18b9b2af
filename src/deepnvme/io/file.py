"""Small whole-file operations the features need next to the engine: reserve space, read a few
bytes through the page cache. Every syscall goes through :mod:`.posix`."""

from __future__ import annotations

import errno

import torch

from ..errors import DeepNVMeIOError
from ..memory.views import byte_view
from . import durable
from .posix import Posix, current

__all__ = ["read_buffered", "reserve"]


def read_buffered(path: str, buffer: torch.Tensor, offset: int, *, posix: Posix | None = None) -> None:
    """Fill the CPU ``buffer`` from ``path`` at ``offset`` through the page cache (small reads).
    Blocks; a short read raises :class:`~deepnvme.errors.ShortTransferError`."""
    posix = posix or current()
    fd = posix.open(path, write=False, direct=False)
    try:
        if buffer.numel():
            posix.read_fully(fd, byte_view(buffer), offset, path=path)
    finally:
        posix.close(fd)


def reserve(path: str, size: int, *, posix: Posix | None = None) -> None:
    """Allocate ``size`` bytes of ``path`` up front (fallocate), so O_DIRECT writes fill reserved
    blocks instead of allocating as they go, and a full disk fails here, before any data moves."""
    if size <= 0:
        return
    posix = posix or current()
    fd = posix.open(path, write=True, direct=False)
    try:
        try:
            posix.fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            durable.wait_for_releases()  # replaced files still being freed: wait, retry once
            posix.fallocate(fd, 0, size)
    except OSError as exc:
        raise DeepNVMeIOError.from_oserror(exc, op="fallocate", path=path, offset=0,
                                           size=size) from None
    finally:
        posix.close(fd)

