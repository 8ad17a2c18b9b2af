"""Memory that goes back to the OS when freed: for large pieces allocated and freed over and over.

Offloaded parameters and gradients come and go every step in pieces of megabytes. glibc's heap
keeps freed pieces below its (dynamic, up to 32 MiB) mmap threshold for reuse, so the RSS of a
process that cycles them grows past what is in use. :func:`mapped_empty` gives such pieces their
own mapping (unmapped when freed); :func:`trim_heap` returns what tensors allocated by torch
(gradients, optimizer temporaries) left free in the heap. Both cost a few syscalls.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import torch

__all__ = ["mapped_empty", "trim_heap"]

MAPPED_MIN = 1 << 20  # below this a plain allocation (the heap reuses small pieces well)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_malloc_trim = getattr(_libc, "malloc_trim", None)   # glibc only


def mapped_empty(nbytes: int) -> torch.Tensor:
    """A page-aligned uint8 tensor of ``nbytes`` in its own anonymous mapping (zeroed), unmapped
    when the tensor is freed; below :data:`MAPPED_MIN` a page-aligned view of a heap allocation
    (one page larger), below a page a plain one.
    Page alignment lets O_DIRECT use the memory without the engine's bounce buffers."""
    if nbytes < mmap.PAGESIZE:  # whole in a buffered edge chunk: alignment would not help
        return torch.empty(nbytes, dtype=torch.uint8)
    if nbytes < MAPPED_MIN:
        raw = torch.empty(nbytes + mmap.PAGESIZE, dtype=torch.uint8)
        pad = -raw.data_ptr() % mmap.PAGESIZE
        return raw[pad:pad + nbytes]
    mm = mmap.mmap(-1, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE,
                   flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mm, dtype=torch.uint8)[:nbytes]


def mapped_at(nbytes: int, file_offset: int, alignment: int = mmap.PAGESIZE) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` whose address is congruent to ``file_offset`` modulo
    ``alignment`` (so an O_DIRECT read of the bytes at ``file_offset`` lands in it without bounce
    buffers), in its own mapping (one ``alignment`` larger) unmapped when freed, from
    :data:`MAPPED_MIN`; below, a view of a heap allocation. Why a mapping: reads freed one by one
    (e.g. a checkpoint read tensor by tensor) would otherwise stay in glibc's heap."""
    raw = (mapped_empty(nbytes + alignment) if nbytes >= MAPPED_MIN
           else torch.empty(nbytes + alignment, dtype=torch.uint8))
    pad = (file_offset - raw.data_ptr()) % alignment
    return raw[pad:pad + nbytes]


def trim_heap() -> bool:
    """Give the heap's free memory back to the OS (glibc ``malloc_trim``); False where unsupported."""
    if _malloc_trim is None:
        return False
    _malloc_trim(0)
    return True
