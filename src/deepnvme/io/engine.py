"""The engine: the one coordinator of planned chunked transfers, over pluggable movers.

One :class:`~deepnvme.io.op.Op` coordinates each request (see there for its guarantees);
the engine opens files, plans, hands chunks to the mover's workers through one work queue
within a window, and completes requests as their chunks come back. Movers only issue chunks
and report completions: the ``threads`` mover runs one blocking syscall per worker
(:meth:`Op.run`); ``io_uring`` and ``aio`` run :func:`~deepnvme.io.kernel.kernel_worker`,
which keeps ``queue_depth`` chunks in flight per worker. A :class:`~deepnvme.io.movers.Mover`
given as ``mover=`` (cuFile) runs its own call per chunk on the worker threads instead.

Concurrency: ``intra_op_parallelism`` worker threads (started on first use). Window: at most
``queue_depth`` chunks handed out per handle with ``threads``, ``queue_depth x
intra_op_parallelism`` with a kernel engine. Bounce memory (only for buffers whose address
O_DIRECT cannot use): at most ``intra_op_parallelism x block_size`` bytes with ``threads``,
``intra_op_parallelism x min(queue_depth, 4) x block_size`` with a kernel engine.
Descriptors: each request opens and closes its file, except ``keep_open`` requests, which share
the engine's kept descriptors (:mod:`deepnvme.io.kept`: at most its limit of files, closed by
:meth:`Engine.close_files` or :meth:`Engine.close`).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import logging
import os
import queue
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import Any

from ..config import IOConfig
from ..errors import ConfigError, DeepNVMeIOError, ShortTransferError
from ..memory.pinned import BufferPool
from ..memory.views import byte_view
from .batch import Items
from .batch import submit_many as _submit_batch
from .kept import KeptFiles, Opened
from .kernel import KernelQueue, kernel_worker
from .movers import EngineProbe, Mover, probe_engines, queue_factory, select_engine
from .op import Op, Transfer
from .plan import Alignment, Kind, plan_transfer
from .posix import POSIX, Posix
from .workers import WorkerGroup

# Transfer is defined in .op, the probes in .movers
__all__ = ["Engine", "Transfer", "EngineProbe", "probe_engines"]

log = logging.getLogger(__name__)
_CLOSED = "this handle/engine is closed; create a new one"


_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()
_fallback_logged: set[str] = set()


class Engine:
    """Executes :class:`Transfer` requests on worker threads; thread-safe.

    Raises :class:`~deepnvme.errors.ConfigError` when the configured engine cannot run here.
    """

    def __init__(self, config: IOConfig, *, posix: Posix = POSIX, mover: Mover | None = None
                 ) -> None:
        self.config = config
        self.posix = posix
        self.mover = mover
        #: the engine in use (``auto`` resolved): "io_uring", "aio" or "threads", or the mover's
        self.name = mover.name if mover is not None else self._choose(config.engine, posix)
        self._make_queue = queue_factory(self.name) if mover is None else None
        self._window = config.queue_depth * (
            config.intra_op_parallelism if self._make_queue is not None else 1)
        self._workers = WorkerGroup(name="deepnvme-io", closed_message=_CLOSED)
        self._queue = self._workers.queue
        self._lock = self._workers.lock
        self._pending: collections.deque[Op] = collections.deque()
        self._inflight = 0
        self._bounce: dict[int, BufferPool] = {}
        self._bounce_views: dict[int, memoryview] = {}
        self._open_ops: set[Op] = self._workers.open
        self._kept = KeptFiles(posix)   # files kept open for ``keep_open`` requests
        _live_engines.add(self)

    @staticmethod
    def _choose(requested: str, posix: Posix) -> str:
        """A ``posix`` that replaces the transfer syscalls (fault injection) is only called by
        the thread mover: ``auto`` then means ``threads``, and a kernel engine is refused."""
        kind = type(posix)
        if kind.preadv is Posix.preadv and kind.pwritev is Posix.pwritev:
            return select_engine(requested)
        if requested not in ("auto", "threads"):
            raise ConfigError(f"engine {requested!r} cannot use {kind.__name__}, which replaces "
                              "preadv/pwritev: only engine 'threads' calls them")
        return "threads"

    # --- submission ----------------------------------------------------------------------

    def submit(self, transfer: Transfer, *, validate: bool = False, fsync: bool | None = None,
               keep_open: bool = False) -> Future[int]:
        """Start a request; the future's result is the number of bytes moved.

        ``keep_open`` (a path target, CPU memory): use the file's kept descriptors, opening
        and keeping them if needed (:mod:`deepnvme.io.kept`), instead of opening and closing
        it for this request. Errors (open failures included) are set on the future, never
        raised here.
        """
        self._workers.check_open()
        op = Op(transfer, validate, self.config.fsync if fsync is None else fsync)
        op.future.set_running_or_notify_cancel()  # the transfer cannot be cancelled once started
        try:
            self._prepare(op, keep_open)
        except BaseException as exc:  # every failure goes to the future
            op.close_fds(self.posix)
            op.future.set_exception(exc)
            return op.future
        if not op.chunks:
            op.finish(self.posix)
            return op.future
        self._admit([op], op)
        return op.future

    def submit_many(self, write: bool, target: str, items: Items, *, validate: bool = False,
                    fsync: bool | None = None, keep_open: bool = False) -> Future[int]:
        """Start one request per item, all on file ``target``, opened once (or kept open,
        as :meth:`submit`); see :mod:`deepnvme.io.batch`."""
        if self.mover is not None:
            raise ValueError(f"submit_many is not supported by the {self.name} mover")
        return _submit_batch(self, write, target, items, validate=validate,
                             fsync=self.config.fsync if fsync is None else fsync,
                             keep_open=keep_open)

    def close_files(self, paths: Iterable[str] = (), *, under: str | None = None) -> None:
        """Close the descriptors kept open for ``paths`` and for the files under the directory
        ``under`` (those in use once their requests end). Call it before deleting or replacing
        a file used with ``keep_open``. Raises the first close failure, naming the file."""
        self._kept.forget(paths, under=under)

    def _admit(self, ops: list[Op], owner: Op) -> None:
        """Queue ``ops``' chunks (an op without chunks completes at once). If the workers
        cannot start, ``owner`` (the request, or its batch) fails with that error and closes
        its descriptors, and the ops are not run."""
        with self._lock:
            if self._workers.closed:  # close() began after submit's check: admit nothing
                owner.close_fds(self.posix)
                self._workers.check_open()
            try:
                self._start_workers()
            except BaseException as exc:
                owner.close_fds(self.posix)
                owner.future.set_exception(exc)
                return
            self._open_ops.add(owner)
            for op in ops:
                if op.chunks:
                    self._pending.append(op)
            self._pump()
        for op in ops:
            if not op.chunks:
                self._ended(op)

    def _start_workers(self) -> None:
        """Start the mover's workers (caller holds the lock); a kernel queue that cannot be
        set up raises here, in the submitting thread."""
        n = self.config.intra_op_parallelism
        if self._make_queue is None:
            self._workers.start(n, _worker, lambda i: (weakref.ref(self), self._queue,
                                                       self.mover))
            return
        make = self._make_queue
        self._workers.start(n, kernel_worker, lambda i: (weakref.ref(self), self._queue,
                                                         make(self.config.queue_depth),
                                                         _close_queue))

    def _prepare(self, op: Op, keep_open: bool = False) -> None:
        t = op.transfer
        if t.file_offset < 0:
            raise DeepNVMeIOError("negative file offset", path=t.name, offset=t.file_offset,
                                  size=t.size, errno=errno.EINVAL)
        if keep_open and self.mover is not None:
            raise ValueError(f"keep_open is not supported by the {self.name} mover")
        alignment = self._open(op, keep_open)
        if not t.write:
            fd = op.fd_direct if op.fd_direct >= 0 else op.fd_buffered
            file_size = self.posix.file_size(fd)
            if t.file_offset + t.size > file_size:
                raise ShortTransferError.past_end(path=t.name, offset=t.file_offset,
                                                  size=t.size, file_size=file_size)
        mover = self.mover  # with one: plain block_size chunks, on the session's descriptor
        op.chunks = plan_transfer(size=t.size, file_offset=t.file_offset, address=t.address,
                                  block_size=self.config.block_size,
                                  alignment=alignment if mover is None else None)
        op.remaining = len(op.chunks)
        if mover is not None:
            op.session = mover.open_session(op) if op.chunks else None
            return
        if any(c.kind is Kind.BUFFERED for c in op.chunks) and op.fd_buffered < 0:
            op.fd_buffered = self._reopen_buffered(op)

    def _open(self, op: Op, keep_open: bool = False) -> Alignment | None:
        """Open the descriptors a request needs (or take the kept ones, with ``keep_open`` and
        a path); returns the O_DIRECT alignment or None."""
        t, px = op.transfer, self.posix
        if isinstance(t.target, int):
            if px.is_direct(t.target):
                op.fd_direct = t.target
                return self._alignment(op.fd_direct, t.name)
            op.fd_buffered = t.target
            return None
        if keep_open:
            kept = self._kept.acquire(t.target, t.write, self._open_path)
            if kept is not None:
                op.kept = kept
                op.fd_direct, op.fd_buffered = kept.fd_direct, kept.fd_buffered
                return kept.alignment
        op.fd_direct, op.fd_buffered, alignment = self._open_path(
            t.target, t.write, False, offset=t.file_offset, size=t.size)
        op.owned_fds += [fd for fd in (op.fd_direct, op.fd_buffered) if fd >= 0]
        return alignment

    def _open_path(self, path: str, write: bool, read_write: bool, *, offset: int | None = None,
                   size: int | None = None) -> Opened:
        """Open ``path`` with O_DIRECT where it works (else buffered): (direct fd or -1,
        buffered fd or -1, alignment or None). ``read_write`` opens O_RDWR (for kept files;
        ``write`` then also creates it). Closes what it opened if it raises."""
        px = self.posix
        mode = {"read_write": True} if read_write else {}  # fakes of open() may not take it
        if self.config.o_direct:
            try:
                fd = px.open(path, write=write, direct=True, offset=offset, size=size, **mode)
            except DeepNVMeIOError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._log_fallback(path, "open(O_DIRECT) returned EINVAL")
            else:
                try:
                    alignment = self._alignment(fd, path)
                except BaseException:
                    px.close(fd)
                    raise
                if alignment is not None:
                    return fd, -1, alignment
                px.close(fd)
        return -1, px.open(path, write=write, direct=False, offset=offset, size=size, **mode), None

    def _alignment(self, fd: int, name: str) -> Alignment | None:
        try:
            found = self.posix.dio_alignment(fd)
        except OSError:
            self._log_fallback(name, "statx reports no O_DIRECT support")
            return None
        if found is None:
            a = self.config.alignment
            return Alignment(memory=a, offset=a)
        return found

    def _reopen_buffered(self, op: Op) -> int:
        """A buffered descriptor for a request's unaligned edges (a kept file keeps its own)."""
        t, kept = op.transfer, op.kept
        path = t.target if isinstance(t.target, str) else f"/proc/self/fd/{t.target}"
        if kept is not None:
            return kept.buffered(lambda: self.posix.open(
                path, write=False, direct=False, offset=t.file_offset, size=t.size,
                **({"read_write": True} if kept.writable else {})))
        fd = self.posix.open(path, write=t.write, direct=False, offset=t.file_offset, size=t.size)
        op.owned_fds.append(fd)
        return fd

    @staticmethod
    def _log_fallback(path: str, why: str) -> None:
        key = os.path.dirname(os.path.abspath(path)) if not path.startswith("<") else path
        if key not in _fallback_logged:
            _fallback_logged.add(key)
            log.warning("deepnvme: buffered I/O instead of O_DIRECT for %s (%s)", key, why)

    # --- dispatch ------------------------------------------------------------------------

    def _pump(self) -> None:
        """Hand chunks to the workers up to the window; caller holds ``self._lock``."""
        depth = self._window
        while self._inflight < depth and self._pending:
            op = self._pending[0]
            chunk = op.chunks[op.next]
            op.next += 1
            if op.next == len(op.chunks):
                self._pending.popleft()
            self._inflight += 1
            self._queue.put((op, chunk))

    @contextlib.contextmanager
    def _borrow_bounce(self, length: int) -> Iterator[memoryview]:
        """An aligned bounce buffer of at least ``length`` bytes, as a memoryview."""
        pool = self._bounce_pool(length)
        buf = pool.acquire()
        try:
            whole = self._bounce_views.get(buf.data_ptr())
            if whole is None:
                whole = self._bounce_views[buf.data_ptr()] = byte_view(buf)
            yield whole[:length]
        finally:
            pool.release(buf)

    def _bounce_pool(self, length: int) -> BufferPool:
        """The pool whose buffers fit ``length`` (chunks are at most the block size rounded up
        to the file's alignment, so there is normally one pool of ``parallelism`` buffers)."""
        size = -(-max(length, self.config.block_size) // 4096) * 4096
        with self._lock:
            for have, pool in self._bounce.items():
                if have >= length:
                    return pool
            pool = self._bounce[size] = BufferPool(size, self.config.intra_op_parallelism)
            return pool

    def _chunks_done(self, ops: list[Op]) -> None:
        """One chunk of each of ``ops`` ended (an op appears once per chunk)."""
        last = []
        with self._lock:
            self._inflight -= len(ops)
            for op in ops:
                op.remaining -= 1
                if op.remaining == 0:
                    last.append(op)
                    if op.batch is None:
                        self._open_ops.discard(op)
            self._pump()
        for op in last:
            self._ended(op)

    def _ended(self, op: Op) -> None:
        """Finish a request whose chunks have all ended (and its batch, if it was the last)."""
        op.finish(self.posix)
        if op.batch is not None and op.batch.child_done(op, self.posix):
            with self._lock:
                self._open_ops.discard(op.batch)

    # --- lifetime ------------------------------------------------------------------------

    def drain(self) -> None:
        """Block until every submitted request has completed (errors stay on their futures)."""
        self._workers.drain()

    def close(self) -> None:
        """Refuse new requests, finish the admitted ones, stop the workers and free bounce
        buffers. Idempotent. Not callable from a worker thread (a future's done-callback)."""
        if not self._workers.close():
            return
        try:
            self._kept.close()
        except DeepNVMeIOError as exc:
            log.error("deepnvme: %s", exc)
        self._bounce_views.clear()
        for pool in self._bounce.values():
            pool.close()
        self._bounce.clear()


def _close_queue(kq: KernelQueue) -> None:
    try:
        kq.close()
    except OSError as exc:
        log.error("deepnvme: closing the %s queue failed: %s", kq.name, exc)


def _worker(engine_ref: weakref.ref[Engine], work: queue.SimpleQueue[Any],
            mover: Mover | None = None) -> None:
    while True:
        item = work.get()
        if item is None:
            return
        engine = engine_ref()
        if engine is None:
            return
        op, chunk = item
        if mover is None:
            op.run(chunk, engine.posix, engine._borrow_bounce)
        else:
            mover.run_chunk(op, chunk)
        engine._chunks_done([op])
        del engine, op, chunk, item


@atexit.register
def _drain_at_exit() -> None:
    """Let queued writes reach the file before the interpreter exits (errors are logged)."""
    for engine in list(_live_engines):
        try:
            engine.drain()
        except Exception as exc:  # noqa: BLE001 - reported, never swallowed silently
            log.error("deepnvme: error while draining I/O at exit: %s", exc)
