"""The mover for kernel-asynchronous queues (io_uring, Linux AIO): one loop per worker thread.

A worker takes chunks from the engine's work queue while it has free slots, queues them on its
own :class:`KernelQueue`, submits them in one batch and waits for completions inside the
system call (without the GIL). Every completion is checked here: ``-EINTR``/``-EAGAIN`` are
resubmitted, a short transfer is resubmitted for its remainder (a direct read that stops at the
end of the file is an error), any other failure fails the chunk's request with its file, offset
and errno. Coordination (windows, first error, completing futures) stays in the engine.

Memory: each worker lends at most ``min(queue_depth, 4)`` aligned bounce buffers of one chunk
each, allocated on first need, for chunks whose memory address O_DIRECT cannot use.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import queue
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..errors import DeepNVMeIOError, ShortTransferError
from ..memory.pinned import new_cpu_locked_tensor
from .plan import Chunk, Kind, align_up

if TYPE_CHECKING:
    from .engine import Engine
    from .op import Op
    from .posix import Posix

__all__ = ["KernelQueue", "kernel_worker", "BOUNCES_PER_WORKER"]

log = logging.getLogger(__name__)
BOUNCES_PER_WORKER = 4
_RETRY = (errno.EINTR, errno.EAGAIN)


class KernelQueue(Protocol):
    """What a kernel mover offers the worker loop (one instance per worker thread)."""

    name: str
    depth: int

    def prep(self, tag: int, write: bool, fd: int, address: int, length: int,
             offset: int) -> int: ...

    def submit_and_wait(self, wait: int, single: bool = False) -> list[tuple[int, int]]: ...

    def close(self) -> None: ...


class _Slot:
    """One chunk in flight: ``done`` bytes of ``length`` moved so far."""

    __slots__ = ("op", "chunk", "fd", "address", "done", "bounce")

    def __init__(self, op: "Op", chunk: Chunk, fd: int, address: int,
                 bounce: torch.Tensor | None) -> None:
        self.op, self.chunk, self.fd, self.address = op, chunk, fd, address
        self.done, self.bounce = 0, bounce


class _Worker:
    def __init__(self, kq: KernelQueue, posix: "Posix", block_size: int, single: bool) -> None:
        self.kq, self.posix, self.single = kq, posix, single
        self.slots: list[_Slot | None] = [None] * kq.depth
        self.free = list(range(kq.depth - 1, -1, -1))
        self.waiting: deque[tuple["Op", Chunk]] = deque()  # taken, waiting for a bounce buffer
        self.bounce_size = align_up(block_size, 4096)
        self.bounces: list[torch.Tensor] = []
        self.bounces_made = 0
        self.bounce_limit = min(kq.depth, BOUNCES_PER_WORKER)
        self.finished: list["Op"] = []

    @property
    def inflight(self) -> int:
        return len(self.slots) - len(self.free)

    # --- starting chunks -----------------------------------------------------------------

    def start(self, op: "Op", chunk: Chunk) -> bool:
        """Queue ``chunk``; False if it must wait for a bounce buffer."""
        if op.stopped:
            self.finished.append(op)
            return True
        t = op.transfer
        bounce = None
        if chunk.kind is Kind.BOUNCE:
            bounce = self._bounce(chunk.length)
            if bounce is None:
                return False
            address = bounce.data_ptr()
            if t.write:
                ctypes.memmove(address, t.address + chunk.buf_offset, chunk.length)
        else:
            address = t.address + chunk.buf_offset
        fd = op.fd_buffered if chunk.kind is Kind.BUFFERED else op.fd_direct
        tag = self.free.pop()
        slot = self.slots[tag] = _Slot(op, chunk, fd, address, bounce)
        self._prep(tag, slot)
        return True

    def _prep(self, tag: int, s: _Slot) -> None:
        self.kq.prep(tag, s.op.transfer.write, s.fd, s.address + s.done, s.chunk.length - s.done,
                     s.chunk.file_offset + s.done)

    def _bounce(self, length: int) -> torch.Tensor | None:
        if self.bounces:
            buf = self.bounces.pop()
            if buf.numel() >= length:
                return buf
        elif self.bounces_made >= self.bounce_limit:
            return None
        else:
            self.bounces_made += 1
        return new_cpu_locked_tensor(max(length, self.bounce_size), torch.uint8)

    # --- completions ---------------------------------------------------------------------

    def complete(self, tag: int, res: int) -> None:
        s = self.slots[tag]
        if s is None:  # the kernel never does this; a stray tag must not kill the worker
            log.error("deepnvme: %s completion for idle slot %d ignored", self.kq.name, tag)
            return
        t, c = s.op.transfer, s.chunk
        if res < 0:
            if -res in _RETRY:
                self._prep(tag, s)
                return
            what = "write" if t.write else "read"
            s.op.fail(DeepNVMeIOError.from_oserror(OSError(-res, errno.errorcode.get(-res, "")),
                                                   op=f"{what} ({self.kq.name})", path=t.name,
                                                   offset=c.file_offset, size=c.length))
        elif res == 0 or (s.done + res < c.length and self._at_eof(s, res)):
            s.op.fail(ShortTransferError("write made no progress" if t.write else
                                         "unexpected end of file", path=t.name,
                                         offset=c.file_offset, size=c.length,
                                         transferred=s.done + max(res, 0)))
        elif s.done + res < c.length:
            s.done += res
            self._prep(tag, s)
            return
        elif s.bounce is not None and not t.write and s.op.error is None:
            ctypes.memmove(t.address + c.buf_offset, s.bounce.data_ptr(), c.length)
        if s.bounce is not None:
            self.bounces.append(s.bounce)
        self.slots[tag] = None
        self.free.append(tag)
        self.finished.append(s.op)

    def _at_eof(self, s: _Slot, res: int) -> bool:
        """A direct read that stops short at the end of the file cannot be resumed (the rest
        is not aligned): name the real cause instead of retrying into EINVAL."""
        if s.op.transfer.write or s.chunk.kind is Kind.BUFFERED:
            return False
        end = s.chunk.file_offset + s.done + res
        return end >= self.posix.file_size(s.fd)

    def fail_all(self, exc: BaseException) -> None:
        """The queue itself failed: fail every chunk held, so no request waits forever."""
        for tag, s in enumerate(self.slots):
            if s is not None:
                s.op.fail(exc)
                self.slots[tag] = None
                self.free.append(tag)
                self.finished.append(s.op)
        while self.waiting:
            op, _ = self.waiting.popleft()
            op.fail(exc)
            self.finished.append(op)


def kernel_worker(engine_ref: "weakref.ref[Engine]", work: "queue.SimpleQueue[Any]",
                  kq: KernelQueue, on_exit: Callable[[KernelQueue], None]) -> None:
    """Thread body: run chunks from ``work`` on ``kq`` until a ``None`` arrives and all is done."""
    engine = engine_ref()
    if engine is None:
        return
    w = _Worker(kq, engine.posix, engine.config.block_size, engine.config.single_submit)
    del engine
    stopping = False
    try:
        while True:
            while w.waiting and w.free and w.start(*w.waiting[0]):
                w.waiting.popleft()
            while not stopping and w.free and not w.waiting:
                try:
                    item = work.get_nowait() if w.inflight or w.finished else work.get()
                except queue.Empty:
                    break
                if item is None:
                    stopping = True
                elif not w.start(*item):
                    w.waiting.append(item)
                item = None  # hold no request past its completion (its buffer stays exported)
            if w.inflight:
                try:
                    events = kq.submit_and_wait(1, w.single)
                except OSError as exc:
                    w.fail_all(DeepNVMeIOError.from_oserror(exc, op=f"{kq.name} submit",
                                                            path=None, offset=None, size=None))
                    events = []
                for tag, res in events:
                    w.complete(tag, res)
            if w.finished:
                engine = engine_ref()
                if engine is None:
                    return
                engine._chunks_done(w.finished)
                w.finished = []
                del engine
            elif stopping and not w.inflight and not w.waiting:
                return
    finally:
        on_exit(kq)

