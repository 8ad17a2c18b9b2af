"""Host memory copies at memory speed: large CPU-to-CPU byte copies shared among threads.

libc's ``memmove`` (through ctypes, which releases the GIL) on several threads copies large
buffers faster than ``Tensor.copy_``, since copies above glibc's non-temporal threshold skip
the cache (``benchmarks/bench_save_parts.py`` measures both). An asynchronous save's caller is
blocked while its snapshot is copied, so snapshots go through :class:`ParallelCopy`.
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

__all__ = ["ParallelCopy", "copy_bytes", "copy_threads"]

_PIECE = 32 << 20
"""Bytes per piece: above glibc's non-temporal threshold, and far more work than a hand-off."""

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def copy_threads() -> int:
    """Threads used for one large copy: the CPUs this process may run on, at most 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, copy_threads() - 1),
                                       thread_name_prefix="deepnvme-copy")
        return _pool


def _forget_pool_after_fork() -> None:
    # a forked child inherits the executor but not its threads: tasks would never run
    global _pool
    _pool = None


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _check_pair(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.numel() != src.numel() or dst.dtype != torch.uint8 or src.dtype != torch.uint8:
        raise ValueError(f"copies need uint8 tensors of equal size, got {dst.dtype} "
                         f"x{dst.numel()} <- {src.dtype} x{src.numel()}")
    if not (dst.is_contiguous() and src.is_contiguous()):
        raise ValueError("copies need contiguous tensors")


class ParallelCopy:
    """Byte copies that start as soon as they are added; :meth:`finish` waits for all of them.

    CPU-to-CPU copies are cut into 32 MiB pieces on a shared queue; up to ``copy_threads() - 1``
    pool threads take pieces from it while the caller goes on, and ``finish()`` lends the
    calling thread too. Other pairs (a CUDA source) are copied by ``dst.copy_(src)`` in
    :meth:`add`. Both tensors of every pair are referenced until ``finish()`` returns.
    """

    def __init__(self) -> None:
        self._pieces: collections.deque[tuple[int, int, int]] = collections.deque()
        self._helpers: list[Future[None]] = []
        self._threads = copy_threads()
        self._keepalive: list[tuple[torch.Tensor, torch.Tensor]] = []

    def add(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``dst[:] = src`` (contiguous uint8 tensors of equal size)."""
        _check_pair(dst, src)
        if dst.device.type != "cpu" or src.device.type != "cpu":
            dst.copy_(src)
            return
        self._keepalive.append((dst, src))
        n, d, s = dst.numel(), dst.data_ptr(), src.data_ptr()
        for start in range(0, n, _PIECE):
            self._pieces.append((d + start, s + start, min(_PIECE, n - start)))
        self._helpers = [f for f in self._helpers if not f.done()]
        if len(self._helpers) < self._threads - 1 and self._pieces:
            self._helpers.append(_executor().submit(self._drain))

    def _drain(self) -> None:
        while True:
            try:
                d, s, n = self._pieces.popleft()  # deque.popleft is atomic: no lock needed
            except IndexError:
                return
            ctypes.memmove(d, s, n)

    def finish(self) -> None:
        """Copy what is left on the calling thread alongside the helpers; wait for them all."""
        try:
            self._drain()
        finally:
            for fut in self._helpers:
                fut.result()
            self._helpers = []
            self._keepalive = []


def copy_bytes(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy each ``src`` into ``dst`` (``(dst, src)`` pairs of contiguous uint8 tensors). Blocks."""
    for dst, src in pairs:
        _check_pair(dst, src)
    copy = ParallelCopy()
    for dst, src in pairs:
        copy.add(dst, src)
    copy.finish()
