"""One request's coordinator: runs its chunks, keeps the first error, completes its future.

Guarantees: the first error wins and chunks not yet started are skipped once it is set; the
caller's buffer (``Transfer.keepalive``) is referenced until the request ends and released
just before its future completes (a caller it wakes may resize or free that memory at once,
while a worker thread still holds the finished request for a moment); descriptors
the request opened are closed exactly once, before the future completes (kept descriptors,
``keep_open``, are released instead); an fsync or
validation failure fails the request like an I/O error does. A mover's per-request
:class:`Session` (e.g. a cuFile handle on the request's descriptor) is closed once, before the
descriptors.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import DeepNVMeIOError, ShortTransferError, ValidationError
from .plan import Chunk, Kind
from .posix import Posix

if TYPE_CHECKING:
    from .kept import KeptFile

__all__ = ["Op", "Batch", "Transfer", "Session", "Gathered"]

_VALIDATE_BLOCK = 8 << 20

BounceLender = Callable[[int], AbstractContextManager[memoryview]]


class Session(Protocol):
    """A mover's state for one request's file, opened after its descriptors (see
    :class:`~deepnvme.io.movers.Mover`). ``close`` runs once, before the descriptors close;
    it raises to fail the request."""

    def close(self) -> None: ...


class Transfer:
    """One request: move ``size`` bytes between memory at ``address`` and ``target`` at
    ``file_offset``. Treat it as immutable.

    ``target`` is a path or an open file descriptor (which the engine never closes).
    ``keepalive`` is held until the request completes (the tensor that owns the memory).
    A plain slotted class, not a frozen dataclass: batches build one per item, and a frozen
    dataclass's ``__init__`` costs several times more; the byte view is made only when a mover
    that needs one (threads, validation) asks for it.
    """

    __slots__ = ("write", "address", "size", "target", "file_offset", "keepalive", "_view")

    def __init__(self, *, write: bool, address: int, size: int, target: str | int,
                 file_offset: int = 0, keepalive: Any = None) -> None:
        self.write, self.address, self.size, self.target = write, address, size, target
        self.file_offset, self.keepalive = file_offset, keepalive
        self._view: memoryview | None = None

    @property
    def view(self) -> memoryview:
        """A writable byte view of the memory (made on first use)."""
        if self._view is None:
            self._view = (memoryview((ctypes.c_char * self.size).from_address(self.address)).cast("B")
                          if self.size else memoryview(bytearray(0)))
        return self._view

    @property
    def name(self) -> str:
        return self.target if isinstance(self.target, str) else f"<fd {self.target}>"

    def buffer_bytes(self, start: int, length: int) -> bytes | bytearray | memoryview:
        """The buffer's bytes ``[start, start + length)`` on the host (validation compares them
        with the file); a transfer of device memory overrides this with a copy."""
        return self.view[start:start + length]

    def __repr__(self) -> str:
        return (f"Transfer(write={self.write}, size={self.size}, target={self.target!r}, "
                f"file_offset={self.file_offset})")


class Op:
    """Coordinator of one request (see the module docstring for its guarantees)."""

    __slots__ = ("transfer", "chunks", "next", "remaining", "error", "future", "fd_direct",
                 "fd_buffered", "owned_fds", "validate", "fsync", "lock", "batch", "session",
                 "kept")

    def __init__(self, transfer: Transfer, validate: bool, fsync: bool, *,
                 batch: Batch | None = None) -> None:
        self.transfer = transfer
        self.chunks: Sequence[Chunk] = []
        self.next = 0
        self.remaining = 0
        self.error: BaseException | None = None
        #: completed by :meth:`finish`; a batch member reports to its batch instead
        self.future: Future[int] = Future() if batch is None else _NO_FUTURE
        self.fd_direct = -1
        self.fd_buffered = -1
        self.owned_fds: list[int] = []
        #: the kept file whose descriptors this request uses (``keep_open``), released on close
        self.kept: KeptFile | None = None
        #: a mover's per-request file state, closed by :meth:`close_fds` before the descriptors
        self.session: Session | None = None
        self.validate = validate
        self.fsync = fsync
        self.lock: threading.Lock = threading.Lock() if batch is None else batch.lock
        self.batch = batch

    def fail(self, exc: BaseException) -> None:
        with self.lock:
            if self.error is None:
                self.error = exc
        if self.batch is not None:
            self.batch.fail(exc)

    @property
    def stopped(self) -> bool:
        """True once this request (or its batch) has failed: its chunks not yet started are
        skipped."""
        return self.error is not None or (self.batch is not None and self.batch.error is not None)

    def run(self, chunk: Chunk, posix: Posix, borrow_bounce: BounceLender) -> None:
        """Execute one chunk on the calling (worker) thread; failures are recorded, not raised."""
        if self.stopped:
            return
        t = self.transfer
        move = posix.write_fully if t.write else posix.read_fully
        try:
            if chunk.kind is Kind.BOUNCE:
                with borrow_bounce(chunk.length) as bounce:
                    bounce_addr = ctypes.addressof(ctypes.c_char.from_buffer(bounce))
                    user_addr = t.address + chunk.buf_offset
                    if t.write:
                        ctypes.memmove(bounce_addr, user_addr, chunk.length)
                    move(self.fd_direct, bounce, chunk.file_offset, path=t.name)
                    if not t.write:
                        ctypes.memmove(user_addr, bounce_addr, chunk.length)
            else:
                fd = self.fd_direct if chunk.kind is Kind.DIRECT else self.fd_buffered
                # from the address, not t.view: a gathered op's chunks hold absolute addresses
                view = memoryview((ctypes.c_char * chunk.length).from_address(
                    t.address + chunk.buf_offset)).cast("B")
                move(fd, view, chunk.file_offset, path=t.name)
        except BaseException as exc:
            self.fail(exc)

    def finish(self, posix: Posix) -> None:
        """After the last chunk: fsync and validate if asked, close descriptors, complete."""
        t = self.transfer
        try:
            if self.error is None and t.write and self.fsync:
                fd = self.fd_direct if self.fd_direct >= 0 else self.fd_buffered
                try:
                    posix.fsync(fd)
                except OSError as exc:
                    self.fail(DeepNVMeIOError.from_oserror(exc, op="fsync", path=t.name,
                                                           offset=t.file_offset, size=t.size))
            if self.error is None and self.validate:
                try:
                    self._validate(posix)
                except BaseException as exc:
                    self.fail(exc)
        finally:
            self.close_fds(posix)
        if self.batch is not None:
            return
        t.keepalive = None
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(t.size)

    def close_fds(self, posix: Posix) -> None:
        session, self.session = self.session, None
        if session is not None:
            try:
                session.close()
            except Exception as exc:  # noqa: BLE001 - fails the request, like a close error
                self.fail(exc)
        for fd in self.owned_fds:
            try:
                posix.close(fd)
            except OSError as exc:
                t = self.transfer
                self.fail(DeepNVMeIOError.from_oserror(exc, op="close", path=t.name,
                                                       offset=t.file_offset, size=t.size))
        self.owned_fds.clear()
        kept, self.kept = self.kept, None
        if kept is not None:
            try:
                kept.release()
            except DeepNVMeIOError as exc:   # closing a forgotten kept file failed
                self.fail(exc)

    def _validate(self, posix: Posix) -> None:
        """Re-read the range (a gathered request: each item's) through a fresh buffered
        descriptor and compare byte for byte."""
        t = self.transfer
        path = t.target if isinstance(t.target, str) else f"/proc/self/fd/{t.target}"
        fd = posix.open(path, write=False, direct=False, offset=t.file_offset, size=t.size)
        try:
            g = self.chunks
            if type(g) is Gathered:
                for address, offset, size in zip(g.addresses, g.offsets, g.sizes):
                    memory = memoryview((ctypes.c_char * size).from_address(address)).cast("B")
                    _compare(posix, fd, t.name, offset, memory)
                return
            for start in range(0, t.size, _VALIDATE_BLOCK):
                n = min(_VALIDATE_BLOCK, t.size - start)
                _compare(posix, fd, t.name, t.file_offset + start, t.buffer_bytes(start, n))
        finally:
            posix.close(fd)


def _compare(posix: Posix, fd: int, name: str, offset: int,
             memory: bytes | bytearray | memoryview) -> None:
    """Read ``len(memory)`` bytes at ``offset`` of ``fd``; ValidationError unless equal."""
    n = len(memory)
    back = bytearray(n)
    try:
        posix.read_fully(fd, memoryview(back), offset, path=name)
    except ShortTransferError as exc:
        raise ValidationError("validation failed: the file ends before the buffer",
                              path=name, offset=offset, size=n) from exc
    if memory != back:
        raise ValidationError("validation failed: file bytes differ from the buffer",
                              path=name, offset=offset, size=n)


_NO_FUTURE: Future[int] = Future()  # placeholder for batch members, never completed


class Gathered(Sequence[Chunk]):
    """The chunks of a request gathering many single-chunk items of a batch: chunk ``i`` is
    ``sizes[i]`` bytes at ``offsets[i]`` of the file and ``addresses[i]`` (absolute) in memory,
    three lists of ints of the request's own (slices of the batch's where its items are
    consecutive); ``largest`` is the largest size.

    A kernel mover takes them as index ranges (no object per chunk); a :class:`Chunk` is made
    only where one is asked for (the thread mover), with the address as its ``buf_offset``.
    """

    __slots__ = ("addresses", "offsets", "sizes", "largest")

    def __init__(self, addresses: list[int], offsets: list[int], sizes: list[int]) -> None:
        self.addresses, self.offsets, self.sizes = addresses, offsets, sizes
        self.largest = max(sizes, default=0)

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, i):  # type: ignore[no-untyped-def]
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self.sizes)))]
        return Chunk(self.addresses[i], self.offsets[i], self.sizes[i], Kind.DIRECT)


class Batch(Op):
    """Several requests on one file opened once (:meth:`Engine.submit_many`): owns the
    descriptors, fsyncs once after the last member, and completes one future with the total
    byte count, or the first failure."""

    __slots__ = ("total",)

    def __init__(self, first: Transfer, validate: bool, fsync: bool) -> None:
        super().__init__(first, validate, fsync)
        self.total = 0

    def child_done(self, op: Op, posix: Posix) -> bool:
        """Count a finished member; on the last one, fsync, close and complete (returns True)."""
        with self.lock:
            self.total += op.transfer.size
            self.remaining -= 1
            if self.remaining:
                return False
        t = self.transfer
        try:
            if self.error is None and t.write and self.fsync:
                try:
                    posix.fsync(self.fd_direct if self.fd_direct >= 0 else self.fd_buffered)
                except OSError as exc:
                    self.fail(DeepNVMeIOError.from_oserror(exc, op="fsync", path=t.name,
                                                           offset=None, size=self.total))
        finally:
            self.close_fds(posix)
        keepalive, t.keepalive = t.keepalive, None
        if isinstance(keepalive, list):  # the handle's list of the items' tensors, shared by
            keepalive.clear()            # every member: the buffers are free once it is empty
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(self.total)
        return True
