"""The thread mover: one blocking call per chunk on each worker thread.

Without a :class:`~deepnvme.io.movers.Mover`, a worker runs :meth:`Op.run` (one
``preadv``/``pwritev``, the GIL released); with one (cuFile), the mover's own
:meth:`~deepnvme.io.movers.Mover.run_chunk`. Each finished chunk is reported to the window.

Memory: chunks whose address O_DIRECT cannot use borrow an aligned bounce buffer from
:class:`Bounces`, at most one per worker at a time: ``intra_op_parallelism x block_size``
bytes (rounded up to 4 KiB), allocated on first need and freed by :meth:`Bounces.close`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..memory.pinned import BufferPool
from ..memory.views import byte_view
from .op import BounceLender

if TYPE_CHECKING:
    from .movers import Mover
    from .posix import Posix
    from .window import Window

__all__ = ["Bounces", "thread_worker"]


class Bounces:
    """Aligned bounce buffers of at least ``block_size`` bytes, ``count`` per size; thread-safe."""

    def __init__(self, block_size: int, count: int) -> None:
        self.block_size = block_size
        self.count = count
        self._lock = threading.Lock()
        self._pools: dict[int, BufferPool] = {}
        self._views: dict[int, memoryview] = {}

    @contextlib.contextmanager
    def borrow(self, length: int) -> Iterator[memoryview]:
        """An aligned bounce buffer of at least ``length`` bytes, as a memoryview."""
        pool = self._pool(length)
        buf = pool.acquire()
        try:
            whole = self._views.get(buf.data_ptr())
            if whole is None:
                whole = self._views[buf.data_ptr()] = byte_view(buf)
            yield whole[:length]
        finally:
            pool.release(buf)

    def _pool(self, length: int) -> BufferPool:
        """The pool whose buffers fit ``length`` (chunks are at most the block size rounded up
        to the file's alignment, so there is normally one pool of ``count`` buffers)."""
        size = -(-max(length, self.block_size) // 4096) * 4096
        with self._lock:
            for have, pool in self._pools.items():
                if have >= length:
                    return pool
            pool = self._pools[size] = BufferPool(size, self.count)
            return pool

    def close(self) -> None:
        """Free the buffers (call once no worker runs)."""
        self._views.clear()
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def thread_worker(window_ref: weakref.ref[Window], work: queue.SimpleQueue[Any], posix: Posix,
                  borrow_bounce: BounceLender, mover: Mover | None = None) -> None:
    """Thread body: run chunks from ``work`` until a ``None`` arrives or the window is gone."""
    while True:
        item = work.get()
        if item is None:
            return
        window = window_ref()
        if window is None:
            return
        op, chunk = item
        if mover is None:
            op.run(chunk, posix, borrow_bounce)
        else:
            mover.run_chunk(op, chunk)
        window.chunks_done([op])
        del window, op, chunk, item
