"""Page-locked, page-aligned CPU tensors that work without CUDA, and a pool of reusable ones.

Without CUDA, memory comes from an anonymous ``mmap`` (page aligned) and is ``mlock``-ed; the
returned tensor owns the mapping, which is unmapped (and so unlocked) when the last tensor
viewing it is garbage-collected. With CUDA, torch's pinned allocator is used so CUDA recognises
the memory for asynchronous copies. Where ``mlock`` is refused (``RLIMIT_MEMLOCK``), the memory
is still aligned but not locked: one warning says so and :func:`is_pinned` returns False.

Allocations of at least one huge page (2 MiB on x86_64) ask for transparent huge pages
(``MADV_HUGEPAGE``, before ``mlock`` faults the memory in): a direct transfer then has one page
per 2 MiB for the kernel to pin and to describe, not 512, which cuts the CPU per byte of
every direct transfer from or into it (BENCHMARKS.md). The system's setting decides
(``/sys/kernel/mm/transparent_hugepage/enabled``: ``always`` or ``madvise`` grant it, ``never``
refuses); where huge pages are not granted, the memory is ordinary pages, as before.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import logging
import mmap
import re
import threading
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch

__all__ = ["PAGE_SIZE", "BufferPool", "free_cpu_locked_tensor", "free_locked_address", "huge_page_mode",
           "huge_page_size", "is_pinned", "locked_bytes", "new_cpu_locked_tensor"]

PAGE_SIZE = mmap.PAGESIZE
log = logging.getLogger(__name__)

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.munlock.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


class _Region:
    __slots__ = ("size", "locked", "transfers", "__weakref__")

    def __init__(self, size: int, locked: bool) -> None:
        self.size = size
        self.locked = locked
        self.transfers = 0  # transfers started from or into it (count_transfer)


# Re-entrant: _forget runs from a weakref finalizer, which the garbage collector may call in
# any thread at any allocation, including inside a block that holds this lock.
_lock = threading.RLock()
_regions: dict[int, _Region] = {}  # storage base address -> region
_bases: list[int] = []  # the keys of _regions, sorted (to find the region holding an address)
_release_listeners: weakref.WeakSet[Any] = weakref.WeakSet()
_warned_mlock = False


_THP = "/sys/kernel/mm/transparent_hugepage"
_huge_page_size: int | None = None  # read on first allocation (nothing is read at import)


def huge_page_size() -> int:
    """Bytes per transparent huge page (``hpage_pmd_size``), 0 where the kernel has none."""
    global _huge_page_size
    if _huge_page_size is None:
        try:
            with open(f"{_THP}/hpage_pmd_size") as f:
                _huge_page_size = int(f.read())
        except (OSError, ValueError):
            _huge_page_size = 0
    return _huge_page_size


def huge_page_mode() -> str:
    """The system's transparent huge page mode: ``always``, ``madvise``, ``never``, or
    ``unavailable`` (no such kernel support, or unreadable)."""
    try:
        with open(f"{_THP}/enabled") as f:
            text = f.read()
    except OSError:
        return "unavailable"
    found = re.search(r"\[(\w+)\]", text)
    return found.group(1) if found else "unavailable"


def _advise_huge(mm: mmap.mmap, size: int) -> None:
    """Ask for huge pages over an allocation of at least one huge page (smaller ones, or a
    kernel without THP that refuses with EINVAL, keep ordinary pages)."""
    page = huge_page_size()
    if not page or size < page or not hasattr(mmap, "MADV_HUGEPAGE"):
        return
    try:
        mm.madvise(mmap.MADV_HUGEPAGE)
    except OSError as exc:
        log.debug("deepnvme: MADV_HUGEPAGE refused for %d bytes: %s", size, exc)


def _mlock(address: int, size: int) -> int:
    """0 on success, else the errno (tests replace this to simulate RLIMIT_MEMLOCK)."""
    return 0 if _libc.mlock(address, size) == 0 else ctypes.get_errno()


def _munlock(address: int, size: int) -> None:
    _libc.munlock(address, size)


def _cuda_pinned_available() -> bool:
    return torch.cuda.is_available()


def _forget(address: int, region: _Region) -> None:
    # mmap's dealloc unmaps (releasing the GIL) before it runs this callback, so another thread
    # may already have mapped and registered the same address: only drop our own entry.
    with _lock:
        if _regions.get(address) is region:
            del _regions[address]
            del _bases[bisect.bisect_left(_bases, address)]
        listeners = list(_release_listeners)
    for listener in listeners:
        listener.region_released(region)


def _warn_unlocked(err: int, size: int) -> None:
    global _warned_mlock
    if not _warned_mlock:
        _warned_mlock = True
        msg = (f"deepnvme: mlock of {size} bytes failed ({errno.errorcode.get(err, err)}: "
               "RLIMIT_MEMLOCK too low?); using aligned but unlocked memory. Raise the limit "
               "(ulimit -l unlimited, or memlock in /etc/security/limits.conf) to lock it.")
        warnings.warn(msg, RuntimeWarning, stacklevel=3)  # once, and not also logged


def _dtype_of(dtype_or_example: torch.dtype | torch.Tensor) -> torch.dtype:
    if isinstance(dtype_or_example, torch.Tensor):
        return dtype_or_example.dtype
    if isinstance(dtype_or_example, torch.dtype):
        return dtype_or_example
    raise TypeError(f"expected a torch.dtype or an example tensor, got {type(dtype_or_example).__name__}")


def new_cpu_locked_tensor(numel: int, dtype_or_example: torch.dtype | torch.Tensor = torch.uint8,
                          *, huge_pages: bool = True) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` elements in page-aligned, page-locked memory.

    The tensor owns its memory (freed when garbage-collected, or at once by
    :func:`free_cpu_locked_tensor`). Contents are zero without CUDA, undefined with it.
    ``huge_pages``: ask for transparent huge pages where the allocation holds one (see the
    module docstring); False keeps ordinary pages; with CUDA, torch's pinned allocator decides.
    Blocking: the kernel zeroes and locks every page before this returns (with huge pages it
    may first compact memory to find them).
    """
    dtype = _dtype_of(dtype_or_example)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    if _cuda_pinned_available():  # CUDA's own page-locked allocator; torch tracks it
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    itemsize = torch.empty((), dtype=dtype).element_size()
    size = max(-(-numel * itemsize // PAGE_SIZE) * PAGE_SIZE, PAGE_SIZE)
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = torch.frombuffer(mm, dtype=torch.uint8)
    address = base.data_ptr()
    if huge_pages:
        _advise_huge(mm, size)
    err = _mlock(address, size)
    if err:
        _warn_unlocked(err, size)
    region = _Region(size, locked=not err)
    with _lock:
        _regions[address] = region
        bisect.insort(_bases, address)
    weakref.finalize(mm, _forget, address, region)
    del mm
    return base[: numel * itemsize].view(dtype)


def free_cpu_locked_tensor(tensor: torch.Tensor) -> bool:
    """Release a tensor from :func:`new_cpu_locked_tensor` now; False if it was not one.

    The memory is unlocked and ``tensor`` is emptied; views taken earlier stay valid (they keep
    the now-unlocked memory alive until they are collected).
    """
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        return False
    address = tensor.untyped_storage().data_ptr()
    with _lock:
        region = _regions.get(address)
        if region is not None:
            was_locked, region.locked = region.locked, False
    if region is None:
        if not (_cuda_pinned_available() and tensor.is_pinned()):
            return False
    elif was_locked:
        _munlock(address, region.size)
    with torch.inference_mode(tensor.is_inference()):  # inference tensors only change inside it
        tensor.set_(torch.empty(0, dtype=tensor.dtype).untyped_storage())
    return True


def free_locked_address(address: int) -> bool:
    """Unlock the memory of a :func:`new_cpu_locked_tensor` allocation by its base address
    (``tensor.untyped_storage().data_ptr()``); False if no locked allocation starts there.

    For callers that kept only the address (DeepSpeed's ``free_cpu_locked_tensor_by_ptr``).
    Tensors viewing the memory stay valid: it returns to the OS when the last one is collected.
    CUDA-pinned tensors (the allocator used when CUDA is available) are not tracked by
    address; release those with :func:`free_cpu_locked_tensor`.
    """
    with _lock:
        region = _regions.get(address)
        if region is None or not region.locked:
            return False
        region.locked = False
    _munlock(address, region.size)
    return True


def locked_region(address: int, length: int) -> tuple[object, int, int] | None:
    """``(region, base, size)`` of the :func:`new_cpu_locked_tensor` allocation holding
    ``[address, address + length)``, or None. ``region`` identifies the allocation (a new one
    at the same address is a different region); I/O queues that register memory with the
    kernel key their registrations by it."""
    with _lock:  # no GC-tracked allocation inside: a finalizer could change the tables
        i = bisect.bisect_right(_bases, address) - 1
        base = _bases[i] if i >= 0 else -1
        region = _regions.get(base)
    if region is None or address + length > base + region.size:
        return None
    return region, base, region.size


def count_transfer(address: int, length: int) -> tuple[object, int] | None:
    """Count a transfer of ``[address, address + length)``: ``(region, transfers before this
    one)`` of the locked allocation holding it (see :func:`locked_region`), or None. The engine
    gives a buffer it has seen before to a mover that registers memory once (io_uring)."""
    found = locked_region(address, length)
    if found is None:
        return None
    region = cast(_Region, found[0])
    with _lock:
        before = region.transfers
        region.transfers = before + 1
    return region, before


def add_release_listener(listener: Any) -> None:
    """Call ``listener.region_released(region)`` when a locked allocation's memory is returned
    to the OS (weakly referenced: a listener that is collected is dropped)."""
    with _lock:
        _release_listeners.add(listener)


def is_pinned(tensor: torch.Tensor) -> bool:
    """True for page-locked memory: CUDA-pinned tensors and live locked tensors and their views."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        return False
    with _lock:
        region = _regions.get(tensor.untyped_storage().data_ptr())
        if region is not None:
            return region.locked
    return _cuda_pinned_available() and tensor.is_pinned()


def locked_bytes() -> int:
    """Bytes currently locked through this module (for tests and ``deepnvme report``)."""
    with _lock:
        regions = list(_regions.values())
    return sum(r.size for r in regions if r.locked)


class BufferPool:
    """At most ``count`` aligned, locked uint8 buffers of ``buffer_bytes``, created on first use.

    ``acquire()`` blocks until a buffer is free (or raises ``TimeoutError`` naming the sizes after
    ``timeout`` seconds). Thread-safe. Memory bound: ``count x buffer_bytes``.
    """

    def __init__(self, buffer_bytes: int, count: int) -> None:
        if buffer_bytes < 1 or count < 1:
            raise ValueError(f"buffer_bytes and count must be >= 1, got {buffer_bytes}, {count}")
        self.buffer_bytes = buffer_bytes
        self.count = count
        self._free: list[torch.Tensor] = []
        self._created = 0
        self._cond = threading.Condition()

    def acquire(self, timeout: float | None = None) -> torch.Tensor:
        with self._cond:
            if not self._free and self._created < self.count:
                self._created += 1
                try:
                    return new_cpu_locked_tensor(self.buffer_bytes, torch.uint8)
                except BaseException:
                    self._created -= 1
                    raise
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise TimeoutError(f"no free buffer in pool of {self.count} x {self.buffer_bytes} "
                                   f"bytes after {timeout} s; raise the count or release buffers")
            return self._free.pop()

    def release(self, buffer: torch.Tensor) -> None:
        with self._cond:
            self._free.append(buffer)
            self._cond.notify()

    @contextmanager
    def borrow(self, timeout: float | None = None) -> Iterator[torch.Tensor]:
        buffer = self.acquire(timeout)
        try:
            yield buffer
        finally:
            self.release(buffer)

    def close(self) -> None:
        """Free the idle buffers now (buffers still borrowed are freed when returned and collected)."""
        with self._cond:
            for buffer in self._free:
                free_cpu_locked_tensor(buffer)
            self._created -= len(self._free)
            self._free.clear()
