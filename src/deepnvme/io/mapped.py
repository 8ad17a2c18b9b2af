"""Copy-on-write mappings of a file, read in up front by parallel ``MADV_POPULATE_READ``.

Why: memory a fresh load allocates is zeroed by the kernel on first touch, which costs as much
as the read itself on a fast device. A private mapping of the file takes page-cache pages that
the device fills instead (as ``torch.load(mmap=True)`` and ``safetensors.load_file`` do), and
populating it from several threads reads the whole file before returning, so nothing faults
later. The pages stay shared with the page cache until written: truncating or rewriting the
file in place afterwards changes the tensors or makes them fault (SIGBUS), as with those peers.
"""

from __future__ import annotations

import errno
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import cast

import torch

from ..errors import DeepNVMeIOError
from ..memory.views import storage_bytes
from .posix import MADV_DONTNEED, MADV_POPULATE_READ, madvise

__all__ = ["POPULATE_CHUNK", "map_private", "populate", "release", "check_span"]

log = logging.getLogger(__name__)

POPULATE_CHUNK = 64 << 20  # bytes per madvise call: small enough to spread over the threads


def map_private(path: str) -> torch.UntypedStorage:
    """The whole of ``path`` as a private (copy-on-write) mapping; reads nothing yet."""
    size = os.path.getsize(path)
    if size == 0:
        return torch.UntypedStorage(0)
    try:
        mapping = torch.UntypedStorage.from_file(path, shared=False, nbytes=size)
    except RuntimeError as exc:
        raise DeepNVMeIOError(f"mmap failed: {exc}", path=path, offset=0, size=size) from None
    return cast(torch.UntypedStorage, mapping)  # from_file on UntypedStorage gives one


def populate(storage: torch.UntypedStorage, *, path: str, threads: int,
             chunk: int = POPULATE_CHUNK, offset: int = 0) -> None:
    """Read every page of a mapping of ``path`` into memory, ``threads`` ranges of ``chunk``
    bytes (a multiple of the page size) at a time; ``offset``: the file offset of the
    storage's first byte (a slice of a whole-file mapping), for error messages.

    Blocks. A page past the end of the file (the file shrank) or a device error raises
    :class:`DeepNVMeIOError` naming the file and the range; a kernel without
    ``MADV_POPULATE_READ`` (before Linux 5.14) gets one read per page instead, said once in the log.
    """
    base, size = storage.data_ptr(), storage.nbytes()
    starts = range(0, size, chunk)

    def one(start: int) -> bool:
        length = min(chunk, size - start)
        try:
            madvise(base + start, length, MADV_POPULATE_READ)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                return False
            raise DeepNVMeIOError.from_oserror(exc, op="populate mapping", path=path,
                                               offset=offset + start, size=length) from None
        return True

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="deepnvme-populate") as pool:
        done = list(pool.map(one, starts))
    if not all(done):
        log.info("deepnvme: MADV_POPULATE_READ is not supported by this kernel; reading %s "
                 "a page at a time", path)
        page = os.sysconf("SC_PAGE_SIZE")
        storage_bytes(storage)[::page].sum()


def release(storage: torch.UntypedStorage) -> None:
    """Unmap the whole pages of ``storage`` (a slice of a private file mapping, never written)
    from this process (``MADV_DONTNEED``): its resident size drops, the pages stay in the page
    cache, and a later access reads them in again. Blocks briefly."""
    page = os.sysconf("SC_PAGE_SIZE")
    lo = -(-storage.data_ptr() // page) * page
    hi = (storage.data_ptr() + storage.nbytes()) // page * page
    if hi > lo:
        madvise(lo, hi - lo, MADV_DONTNEED)


def check_span(mapping: torch.UntypedStorage, *, path: str, offset: int, size: int) -> None:
    """Raise :class:`DeepNVMeIOError` naming ``path`` and the range if bytes ``[offset, offset +
    size)`` lie past the end of ``mapping`` (the file is shorter than its index says)."""
    if offset + size > mapping.nbytes():
        raise DeepNVMeIOError(f"short read: the file ends at byte {mapping.nbytes()}, before the end "
                              f"of the {size} bytes wanted at offset {offset} (truncated?)",
                              path=path, offset=offset, size=size)
