"""Shared plumbing of the checkpoint features: config defaults, byte views, batched engine I/O."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from .._buffers import byte_view
from ..config import IOConfig, resolve_config
from ..errors import DeepNVMeIOError
from ..handle import AioHandle
from ..io.posix import POSIX, Posix
from . import atomic

__all__ = ["CHECKPOINT_DEFAULTS", "checkpoint_config", "storage_bytes", "aligned_empty",
           "write_at", "read_at", "as_path"]

CHECKPOINT_DEFAULTS: Mapping[str, int] = {"intra_op_parallelism": 4, "queue_depth": 32}
"""Checkpoint I/O settings used where the resolved config still has the library default."""


def as_path(path: object, func: str, accepted: str = "a str or os.PathLike file path") -> str:
    """``path`` as a str for ``func``; anything else is a TypeError saying what is accepted."""
    if isinstance(path, (str, os.PathLike)):
        name = os.fspath(path)
        if isinstance(name, str):
            return name
    raise TypeError(f"{func}: path must be {accepted}, got {type(path).__name__} {path!r}")


def checkpoint_config(config: IOConfig | Mapping[str, Any] | None) -> IOConfig:
    """Resolve ``config``; settings left at the library default take :data:`CHECKPOINT_DEFAULTS`.

    Checkpoints are large transfers: a few threads keep the disk busy while bounce-buffer
    copies (tensor memory is rarely O_DIRECT-aligned) run on another core.
    """
    if isinstance(config, IOConfig):
        return config
    cfg = resolve_config(config)
    base = IOConfig()
    given = dict(config or {})
    changes = {k: v for k, v in CHECKPOINT_DEFAULTS.items()
               if given.get(k) is None and getattr(cfg, k) == getattr(base, k)}
    return cfg.replace(**changes)


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 CPU tensor aliasing a storage's bytes (CUDA storages are copied to CPU)."""
    if storage.device.type != "cpu":
        storage = storage.cpu()
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def aligned_empty(nbytes: int, file_offset: int = 0, alignment: int = 4096) -> torch.Tensor:
    """An uninitialised uint8 tensor whose address is congruent to ``file_offset`` modulo ``alignment``.

    Its storage is exactly ``nbytes`` long (a view of a slightly larger allocation), so
    O_DIRECT reads of the data at ``file_offset`` land in it without bounce buffers.
    """
    if nbytes < 64 * 1024:
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8).untyped_storage()
    pad = (file_offset - raw.data_ptr()) % alignment
    return torch.empty(0, dtype=torch.uint8).set_(raw[pad:pad + nbytes])


def _run(handle: AioHandle, path: str, write: bool, items: Sequence[tuple[torch.Tensor, int]],
         fsync: bool, posix: Posix) -> None:
    # Requests name the path (not a shared descriptor) so every error names the file.
    futures: list[Future[int]] = []
    for tensor, offset in items:
        if tensor.numel() == 0:
            continue
        submit = handle.submit_write if write else handle.submit_read
        futures.append(submit(tensor, path, offset=offset))
    wait_all(futures)
    if write and fsync:
        fd = posix.open(path, write=False, direct=False)
        try:
            posix.fsync(fd)
        except OSError as exc:
            raise DeepNVMeIOError.from_oserror(exc, op="fsync", path=path, offset=0,
                                               size=None) from None
        finally:
            posix.close(fd)


def wait_all(futures: Iterable[Future[int] | None]) -> None:
    """Wait for every future (so no buffer is released while in flight); raise the first error."""
    first: BaseException | None = None
    for fut in futures:
        if fut is None:
            continue
        exc = fut.exception()
        if exc is not None and first is None:
            first = exc
    if first is not None:
        raise first


def read_buffered(path: str, buffer: torch.Tensor, offset: int, *, posix: Posix = POSIX) -> None:
    """Fill ``buffer`` from ``path`` at ``offset`` through the page cache (small reads). Blocks."""
    fd = posix.open(path, write=False, direct=False)
    try:
        if buffer.numel():
            posix.read_fully(fd, byte_view(buffer), offset, path=path)
    finally:
        posix.close(fd)


def reserve(path: str, size: int, *, posix: Posix = POSIX) -> None:
    """Allocate ``size`` bytes of ``path`` up front (fallocate): O_DIRECT writes then fill
    reserved blocks instead of allocating as they go, and a full disk fails here, early."""
    if size <= 0:
        return
    fd = posix.open(path, write=True, direct=False)
    try:
        try:
            posix.fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
            atomic.wait_for_releases()  # replaced checkpoints still being freed: wait, retry once
            posix.fallocate(fd, 0, size)
    except OSError as exc:
        raise DeepNVMeIOError.from_oserror(exc, op="fallocate", path=path, offset=0,
                                           size=size) from None
    finally:
        posix.close(fd)


def write_at(handle: AioHandle, path: str, items: Sequence[tuple[torch.Tensor, int]], *,
             fsync: bool = True, posix: Posix = POSIX) -> None:
    """Write each (contiguous CPU tensor, file offset) in parallel, then fsync. Blocks."""
    _run(handle, path, True, items, fsync, posix)


def read_at(handle: AioHandle, path: str, items: Sequence[tuple[torch.Tensor, int]], *,
            posix: Posix = POSIX) -> None:
    """Fill each (tensor, file offset) from ``path`` in parallel. Blocks; short reads raise."""
    _run(handle, path, False, items, False, posix)


def file_size(path: str) -> int:
    return os.stat(path).st_size
