"""The mover for kernel-asynchronous queues (io_uring, Linux AIO): one loop per worker thread.

A worker takes chunks from the engine's work queue while it has free slots, queues them on its
own :class:`KernelQueue`, submits them in one batch and waits inside the system call
(without the GIL) until a share (``wait_share``) of its chunks in flight have completed;
the places they free are refilled from the window at once, with no hand-off through the work
queue (:meth:`Window.chunks_done <deepnvme.io.window.Window.chunks_done>`). Every completion
is checked here: ``-EINTR``/``-EAGAIN`` are resubmitted, a short transfer is resubmitted for
its remainder (a direct read that stops at the end of the file is an error), any other failure
fails the chunk's request with its file, offset and errno. Coordination (the window, first
error, completing futures) stays in :mod:`deepnvme.io.window` and :mod:`deepnvme.io.op`.

Memory: each worker lends at most ``min(queue_depth, 4)`` aligned bounce buffers of one chunk
each, allocated together (one locked slab) on first need, for chunks whose memory address
O_DIRECT cannot use.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import queue
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol, Union, cast

import torch

from ..errors import DeepNVMeIOError, ShortTransferError
from ..memory.pinned import new_cpu_locked_tensor
from .plan import Chunk, Kind, align_up

if TYPE_CHECKING:
    from .op import Gathered, Op
    from .posix import Posix
    from .window import Window

__all__ = ["KernelQueue", "kernel_worker", "BOUNCES_PER_WORKER"]

log = logging.getLogger(__name__)
BOUNCES_PER_WORKER = 4
IDLE_TIDY_S = 1.0  # how often an idle worker lets its queue drop what it must (UringQueue.tidy)
FIXED_MIN_BYTES = 64 << 10  # smallest chunk worth a registered-buffer look-up
_RETRY = (errno.EINTR, errno.EAGAIN)
#: a work item: one chunk ``(op, chunk)`` or a range of a gathered request ``(op, start, stop)``
Item = Union["tuple[Op, Chunk]", "tuple[Op, int, int]"]


class KernelQueue(Protocol):
    """What a kernel mover offers the worker loop (one instance per worker thread)."""

    name: str
    depth: int
    #: a worker waits for ``1 / wait_share`` of its chunks in flight (at least one) to complete
    #: per system call (fio's iodepth_batch_complete_min)
    wait_share: int
    #: the same for a batch of small reads (:mod:`deepnvme.io.small`)
    small_wait_share: int

    def prep(self, tag: int, write: bool, fd: int, address: int, length: int,
             offset: int, buf_index: int = -1) -> int: ...

    def prep_many(self, tags: list[int], write: bool, fd: int, addresses: list[int],
                  lengths: list[int], offsets: list[int], slots: list[int] | None) -> None: ...

    def fixed_slot(self, address: int, length: int) -> int: ...

    def submit_and_wait(self, wait: int, single: bool = False) -> list[tuple[int, int]]: ...

    # tables (:mod:`deepnvme.io.small`): a batch's entries built in bulk, tagged by row

    def table(self, write: bool, fd: int, addresses: torch.Tensor, offsets: torch.Tensor,
              sizes: torch.Tensor) -> torch.Tensor: ...

    def set_row(self, table: torch.Tensor, i: int, address: int, length: int, offset: int) -> None: ...

    def prep_rows(self, table: torch.Tensor, start: int, count: int) -> None: ...

    def submit_wait(self, wait: int, most: int = 0) -> tuple[list[int], list[int]]:
        """Submit (at most ``most`` entries per system call; 0: all at once), wait for ``wait``
        completions, return their tags and results as two lists."""
        ...

    def tidy(self) -> bool: ...

    def close(self) -> None: ...


class _Worker:
    """One worker's chunks in flight, by tag (parallel lists: cheaper than an object per chunk).

    Slot ``tag`` holds a chunk of request ``op[tag]``: ``length[tag]`` bytes at file
    ``offset[tag]`` of ``kind[tag]``, to or from ``address[tag]`` (the bounce buffer
    ``bounce[tag]`` if it borrowed one, else the caller's ``user[tag]``); ``done[tag]`` bytes
    have moved. A chunk of a gathered range records only ``op``, ``length`` and its index in
    the request, ``item[tag]`` (>= 0): the rest is filled from the request's lists when a
    completion needs it (:meth:`_fill`). A free slot has ``done`` 0 and no bounce buffer.
    """

    def __init__(self, kq: KernelQueue, posix: Posix, block_size: int, single: bool) -> None:
        self.kq, self.posix, self.single = kq, posix, single
        depth = kq.depth
        self.op: list[Op | None] = [None] * depth
        self.item = [-1] * depth
        self.kind = [Kind.DIRECT] * depth
        self.fd = [0] * depth
        self.address = [0] * depth
        self.user = [0] * depth
        self.offset = [0] * depth
        self.length = [0] * depth
        self.slot = [-1] * depth  # registered-buffer slot, or -1
        self.done = [0] * depth
        self.bounce: list[torch.Tensor | None] = [None] * depth
        self.free = list(range(depth - 1, -1, -1))
        self.waiting: deque[Item] = deque()  # taken, not yet started (slots or bounce buffers)
        self.bounce_size = align_up(block_size, 4096)
        self.spare: list[torch.Tensor] = []
        self.bounces_made = 0
        self.bounce_limit = min(depth, BOUNCES_PER_WORKER)
        self.finished: list[Op] = []

    @property
    def inflight(self) -> int:
        return len(self.op) - len(self.free)

    # --- starting chunks -----------------------------------------------------------------

    def start(self, op: Op, chunk: Chunk) -> bool:
        """Queue ``chunk``; False if it must wait for a bounce buffer."""
        if op.stopped:
            self.finished.append(op)
            return True
        t = op.transfer
        kind = chunk.kind
        bounce = None
        user = t.address + chunk.buf_offset
        if kind is Kind.BOUNCE:
            bounce = self._bounce(chunk.length)
            if bounce is None:
                return False
            address = bounce.data_ptr()
            if t.write:
                ctypes.memmove(address, user, chunk.length)
        else:
            address = user
        fd = op.fd_buffered if kind is Kind.BUFFERED else op.fd_direct
        # big direct chunks from locked memory skip per-request page pinning (io_uring);
        # measured no gain for small chunks, which then skip the look-up too
        slot = (self.kq.fixed_slot(address, chunk.length)
                if kind is not Kind.BUFFERED and chunk.length >= FIXED_MIN_BYTES else -1)
        tag = self.free[-1]
        self.kq.prep(tag, t.write, fd, address, chunk.length, chunk.file_offset, slot)
        self.free.pop()
        self.op[tag], self.item[tag], self.kind[tag], self.fd[tag], self.slot[tag] = op, -1, kind, fd, slot
        self.address[tag], self.user[tag], self.bounce[tag] = address, user, bounce
        self.offset[tag], self.length[tag] = chunk.file_offset, chunk.length
        return True

    def start_range(self, op: Op, start: int, stop: int) -> int:
        """Queue chunks ``start`` to ``stop`` of a gathered request (direct chunks at absolute
        addresses) while slots are free, all in one :meth:`KernelQueue.prep_many`; returns the
        index of the first chunk not queued."""
        if op.stopped:
            self.finished.extend([op] * (stop - start))
            return stop
        free = self.free
        n = min(len(free), stop - start)
        if not n:
            return start
        g = cast("Gathered", op.chunks)
        end = start + n
        addresses, lengths = g.addresses[start:end], g.sizes[start:end]
        slots = None
        if g.largest >= FIXED_MIN_BYTES:  # as in start: only big chunks look for a slot
            fixed = self.kq.fixed_slot
            slots = [fixed(a, ln) if ln >= FIXED_MIN_BYTES else -1
                     for a, ln in zip(addresses, lengths)]
        tags = free[-n:]
        self.kq.prep_many(tags, op.transfer.write, op.fd_direct, addresses, lengths,
                          g.offsets[start:end], slots)
        del free[-n:]  # queued: from here on nothing raises
        ops, item, length = self.op, self.item, self.length
        for i, tag, ln in zip(range(start, end), tags, lengths):
            ops[tag], item[tag], length[tag] = op, i, ln
        if slots is not None:
            for tag, sl in zip(tags, slots):
                self.slot[tag] = sl
        return end

    def _fill(self, tag: int, op: Op) -> None:
        """Record the whole state of a gathered range's chunk in slot ``tag`` (kept lean
        while it was in flight), for a completion that needs more than its length."""
        i = self.item[tag]
        if i < 0:
            return
        g = cast("Gathered", op.chunks)
        self.item[tag] = -1
        self.kind[tag], self.fd[tag] = Kind.DIRECT, op.fd_direct
        self.address[tag] = self.user[tag] = g.addresses[i]
        self.offset[tag] = g.offsets[i]
        if g.largest < FIXED_MIN_BYTES:
            self.slot[tag] = -1  # (else start_range recorded it)

    def _resubmit(self, tag: int, op: Op) -> None:
        done = self.done[tag]
        self.kq.prep(tag, op.transfer.write, self.fd[tag], self.address[tag] + done,
                     self.length[tag] - done, self.offset[tag] + done, self.slot[tag])

    def _bounce(self, length: int) -> torch.Tensor | None:
        """A free bounce buffer of at least ``length`` bytes, or None while all are lent. The
        first need allocates all of them as one locked slab (large enough for huge pages:
        the kernel then pins a few large pages per chunk, not one page per 4 KiB)."""
        if not self.bounces_made and length <= self.bounce_size:
            slab = new_cpu_locked_tensor(self.bounce_limit * self.bounce_size, torch.uint8)
            self.spare = list(slab.split(self.bounce_size))
            self.bounces_made = self.bounce_limit
        if self.spare:
            buf = self.spare.pop()
            if buf.numel() >= length:
                return buf
        elif self.bounces_made >= self.bounce_limit:
            return None
        else:
            self.bounces_made += 1
        return new_cpu_locked_tensor(max(length, self.bounce_size), torch.uint8)

    # --- completions ---------------------------------------------------------------------

    def complete_many(self, events: list[tuple[int, int]]) -> None:
        """Handle ``(tag, result)`` completions: whole transfers without a bounce buffer (the
        common case) end here, every other one goes through :meth:`complete`."""
        ops, length, done, bounce = self.op, self.length, self.done, self.bounce
        free, finished = self.free, self.finished
        for tag, res in events:
            op = ops[tag]
            if op is not None and res == length[tag] - done[tag] and bounce[tag] is None:
                ops[tag] = None
                done[tag] = 0
                free.append(tag)
                finished.append(op)
            else:
                _complete(self, tag, res)

    def complete(self, tag: int, res: int) -> None:
        op = self.op[tag]
        if op is None:  # the kernel never does this; a stray tag must not kill us
            log.error("deepnvme: %s completion for idle slot %d ignored", self.kq.name, tag)
            return
        self._fill(tag, op)
        offset, length, done = self.offset[tag], self.length[tag], self.done[tag]
        if res == length - done and self.bounce[tag] is None:
            self._release(tag, op)
            return
        t = op.transfer
        if res < 0:
            if -res in _RETRY:
                self._resubmit(tag, op)
                return
            what = "write" if t.write else "read"
            op.fail(DeepNVMeIOError.from_oserror(OSError(-res, errno.errorcode.get(-res, "")),
                                                 op=f"{what} ({self.kq.name})", path=t.name,
                                                 offset=offset, size=length))
        elif res == 0 or (done + res < length and self._at_eof(tag, op, res)):
            op.fail(ShortTransferError("write made no progress" if t.write else
                                       "unexpected end of file", path=t.name,
                                       offset=offset, size=length,
                                       transferred=done + max(res, 0)))
        elif done + res < length:
            self.done[tag] += res
            self._resubmit(tag, op)
            return
        bounce = self.bounce[tag]
        if bounce is not None:
            if not t.write and op.error is None:
                ctypes.memmove(self.user[tag], bounce.data_ptr(), length)
            self.spare.append(bounce)
            self.bounce[tag] = None
        self._release(tag, op)

    def abandon(self, tag: int, op: Op, exc: BaseException) -> None:
        """End the chunk in slot ``tag`` with ``exc`` as its request's error."""
        op.fail(exc)
        bounce = self.bounce[tag]
        if bounce is not None:
            self.spare.append(bounce)
            self.bounce[tag] = None
        self._release(tag, op)

    def _release(self, tag: int, op: Op) -> None:
        self.op[tag], self.item[tag], self.done[tag] = None, -1, 0
        self.free.append(tag)
        self.finished.append(op)

    def _at_eof(self, tag: int, op: Op, res: int) -> bool:
        """A direct read that stops short at the end of the file cannot be resumed (the rest
        is not aligned): name the real cause instead of retrying into EINVAL."""
        if op.transfer.write or self.kind[tag] is Kind.BUFFERED:
            return False
        end = self.offset[tag] + self.done[tag] + res
        return end >= self.posix.file_size(self.fd[tag])

    def fail_all(self, exc: BaseException) -> None:
        """The queue itself failed: fail every chunk held, so no request waits forever."""
        for tag, op in enumerate(self.op):
            if op is not None:
                self.abandon(tag, op, exc)
        while self.waiting:
            item = self.waiting.popleft()
            item[0].fail(exc)
            self.finished.extend([item[0]] * _count(item))


def kernel_worker(window_ref: weakref.ref[Window], work: queue.SimpleQueue[Any],
                  kq: KernelQueue, posix: Posix, block_size: int, single_submit: bool,
                  on_exit: Callable[[KernelQueue], None]) -> None:
    """Thread body: run chunks from ``work`` on ``kq`` until a ``None`` arrives and all is done
    (or the window is gone); ``on_exit(kq)`` closes the queue."""
    try:
        _run(_Worker(kq, posix, block_size, single_submit), window_ref, work, kq)
    finally:
        on_exit(kq)


def _count(item: Item) -> int:
    return item[2] - item[1] if len(item) == 3 else 1


def _start(w: _Worker, item: Item) -> Item | None:
    """Start what can start of ``item``; returns the part that must wait (for free slots or a
    bounce buffer), or None. An unexpected failure (no memory for a bounce buffer ...) becomes
    the request's error instead of killing the worker."""
    op = item[0]
    try:
        if len(item) == 2:
            return None if w.start(op, item[1]) else item
        nxt = w.start_range(op, item[1], item[2])
        return None if nxt == item[2] else (op, nxt, item[2])
    except Exception as exc:  # noqa: BLE001 - recorded on the request, raised by its future
        op.fail(exc)
        w.finished.extend([op] * _count(item))
        return None


def _complete(w: _Worker, tag: int, res: int) -> None:
    """``w.complete`` that turns an unexpected failure (the file size check after a short read
    failing ...) into the request's error and frees the slot, so no chunk is ever lost."""
    try:
        w.complete(tag, res)
    except Exception as exc:  # noqa: BLE001 - recorded on the request, raised by its future
        op = w.op[tag]
        if op is not None:
            w.abandon(tag, op, exc)


def _idle_get(work: queue.SimpleQueue[Any], kq: KernelQueue) -> Any:
    """The next work item, for a worker with nothing in flight; meanwhile the queue drops what
    it could not from other threads (a single-issuer ring's registrations of freed memory),
    now and every :data:`IDLE_TIDY_S` seconds while it holds any."""
    while True:
        if not kq.tidy():
            return work.get()
        try:
            return work.get(timeout=IDLE_TIDY_S)
        except queue.Empty:
            continue


def _run(w: _Worker, window_ref: weakref.ref[Window], work: queue.SimpleQueue[Any],
         kq: KernelQueue) -> None:
    """Every completion reaped by one system call is handled, and its slots refilled, before
    the next call: one call, one hand-off to the window and one lock per round of
    completions, not per few of them."""
    stopping = False
    depth, share = len(w.op), kq.wait_share
    while True:
        while w.waiting and w.free:
            rest = _start(w, w.waiting[0])
            if rest is not None:
                w.waiting[0] = rest
                break
            w.waiting.popleft()
        while not stopping and w.free and not w.waiting:
            busy = len(w.free) < depth or w.finished
            if busy and work.empty():  # cheaper than raising queue.Empty every round
                break
            try:
                item = work.get_nowait() if busy else _idle_get(work, kq)
            except queue.Empty:  # another worker took it
                break
            if item is None:
                stopping = True
            else:
                rest = _start(w, item)
                if rest is not None:
                    w.waiting.append(rest)
            item = rest = None  # hold no request past its completion (its buffer stays exported)
        inflight = depth - len(w.free)
        if inflight:
            try:
                # submit what was queued, wait for a share of what is in flight
                events = kq.submit_and_wait(max(1, inflight // share), w.single)
            except OSError as exc:
                w.fail_all(DeepNVMeIOError.from_oserror(exc, op=f"{kq.name} submit",
                                                        path=None, offset=None, size=None))
                events = []
            w.complete_many(events)
        if w.finished:
            window = window_ref()
            if window is None:
                return
            # the window hands the places just freed back at once, to start here (a request
            # that failed meanwhile reports its skipped chunks as finished, next round)
            finished, w.finished = w.finished, []
            for item in window.chunks_done(finished, 0 if w.waiting else len(w.free)):
                rest = _start(w, item)
                if rest is not None:
                    w.waiting.append(rest)
            del window, finished
            item = rest = None
        elif stopping and not w.inflight and not w.waiting:
            return
