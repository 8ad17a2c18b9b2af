"""The dispatch window: admitted requests' chunks handed to the mover's workers, at most
``size`` at a time, and requests completed as their chunks come back.

The engine and batches admit requests here (:meth:`Window.admit`); the workers report each
finished chunk (:meth:`Window.chunks_done`), which frees a place in the window for the next.
A window made with ``span`` hands a gathered request's chunks (:class:`~deepnvme.io.op.Gathered`)
as ranges ``(op, start, stop)`` of at most ``span`` chunk indices, one queue item for many small
reads; other chunks go one at a time as ``(op, chunk)``. Workers of such a window take both.
The workers are started on first admission by the ``start`` function the window is made with,
which receives a weak reference to the window (a worker never keeps its window alive).
Thread-safety: one lock (the worker group's) guards admission and the counters.
"""

from __future__ import annotations

import collections
import weakref
from collections.abc import Callable
from typing import Union

from .op import Gathered, Op
from .plan import Chunk
from .posix import Posix
from .workers import WorkerGroup

__all__ = ["Window", "StartWorkers", "Item"]

#: a work item: one chunk ``(op, chunk)``, or chunks ``start`` to ``stop`` of a gathered request
Item = Union["tuple[Op, Chunk]", "tuple[Op, int, int]"]
#: ``start(group, window_ref)`` starts the group's worker threads (caller holds its lock)
StartWorkers = Callable[[WorkerGroup, "weakref.ref[Window]"], None]


class Window:
    """At most ``size`` chunks handed out at once, over ``posix`` (for closing and fsync).

    ``closed_message`` is the ``RuntimeError`` raised once :meth:`close` began; ``span`` > 0
    hands gathered chunks as ranges of at most ``span`` (see the module docstring).
    """

    def __init__(self, size: int, posix: Posix, start: StartWorkers, *,
                 closed_message: str, span: int = 0) -> None:
        self.size = size
        self.span = span
        self.posix = posix
        self._start = start
        self.workers = WorkerGroup(name="deepnvme-io", closed_message=closed_message)
        self._pending: collections.deque[Op] = collections.deque()
        self._inflight = 0

    def check_open(self) -> None:
        """Raise ``RuntimeError`` once :meth:`close` has begun."""
        self.workers.check_open()

    def admit(self, ops: list[Op], owner: Op) -> None:
        """Queue ``ops``' chunks (an op without chunks completes at once). If the workers
        cannot start, ``owner`` (the request, or its batch) fails with that error and closes
        its descriptors, and the ops are not run."""
        group = self.workers
        with group.lock:
            if group.closed:  # close() began after the caller's check: admit nothing
                owner.close_fds(self.posix)
                group.check_open()
            try:
                self._start(group, weakref.ref(self))
            except BaseException as exc:
                owner.close_fds(self.posix)
                owner.future.set_exception(exc)
                return
            group.open.add(owner)
            for op in ops:
                if op.chunks:
                    self._pending.append(op)
            self._pump()
        for op in ops:
            if not op.chunks:
                self._ended(op)

    def _pump(self, take: int = 0) -> list[Item]:
        """Hand chunks to the workers up to the window: the first ``take`` chunks' worth
        returned (for the calling worker to start at once), the rest through the work queue;
        caller holds the lock."""
        put, span, size = self.workers.queue.put, self.span, self.size
        mine: list[Item] = []
        while self._inflight < size and self._pending:
            op = self._pending[0]
            chunks, start = op.chunks, op.next
            if span and type(chunks) is Gathered:
                total = len(chunks.sizes)
                n = min(size - self._inflight, total - start, span)
                if 0 < take < n:
                    n = take
                item: Item = (op, start, start + n)
            else:
                total, n = len(chunks), 1
                item = (op, chunks[start])
            if take > 0:
                mine.append(item)
                take -= n
            else:
                put(item)
            op.next = start + n
            if op.next == total:
                self._pending.popleft()
            self._inflight += n
        return mine

    def chunks_done(self, ops: list[Op], take: int = 0) -> list[Item]:
        """One chunk of each of ``ops`` ended (an op appears once per chunk); called by the
        workers. A worker with ``take`` free places gets up to that many chunks' worth of
        work back to start itself (no hand-off through the work queue)."""
        last = []
        group = self.workers
        # a gathered request recurs once per chunk: count in C (mostly one request per round)
        counts = ((ops[0], len(ops)),) if ops.count(ops[0]) == len(ops) else collections.Counter(ops).items()
        with group.lock:
            self._inflight -= len(ops)
            for op, n in counts:
                op.remaining -= n
                if op.remaining == 0:
                    last.append(op)
                    if op.batch is None:
                        group.open.discard(op)
            mine = self._pump(take)
        for op in last:
            self._ended(op)
        return mine

    def _ended(self, op: Op) -> None:
        """Finish a request whose chunks have all ended (and its batch, if it was the last)."""
        op.finish(self.posix)
        if op.batch is not None and op.batch.child_done(op, self.posix):
            with self.workers.lock:
                self.workers.open.discard(op.batch)

    def drain(self) -> None:
        """Block until every admitted request has completed (errors stay on their futures)."""
        self.workers.drain()

    def close(self) -> bool:
        """Refuse new requests, finish the admitted ones, stop the workers; False if already
        closed. Not callable from a worker thread (a future's done-callback)."""
        return self.workers.close()
