"""Batches of small direct reads on queues of their own: one hand-off per batch, no Python
object per read.

A batch whose items are all reads of one aligned O_DIRECT chunk of at most :data:`SMALL_MAX`
bytes (shuffled samples, random reads) goes from :meth:`Engine.submit_many
<deepnvme.io.engine.Engine.submit_many>` to the :class:`SmallReads` of its mover instead of the
dispatch window. It is cut into at most ``intra_op_parallelism`` parts, each run by one of as
many threads on its own kernel queue (a single-issuer ring: that thread is its one issuer).
A part's entries are built in bulk (:meth:`KernelQueue.table
<deepnvme.io.kernel.KernelQueue.table>`: one 64-byte row per read, tagged by its row) and
copied into the queue up to ``queue_depth`` in flight (all free slots per system call, or
:data:`SUBMIT_MOST`); each round's completions come back as
two lists and are checked with one C-level comparison while every read is whole.

The guarantees are the kernel mover's (:mod:`deepnvme.io.kernel`): every completion is checked;
``-EINTR``/``-EAGAIN`` are resubmitted and a short read for its remainder; a failed read, or a
read that stops at the end of the file, fails the batch naming the file, offset and errno; the
first error wins and stops what is not yet queued, and the reads in flight are waited for
before the future completes. A queue whose system call fails is closed (Linux AIO waits for
its reads there) and replaced by the next batch. Closing waits for the batches admitted.

Memory: 64 bytes of table per read of a running part; ``intra_op_parallelism`` threads, each
with one queue of ``queue_depth`` entries, per kernel mover in use (made on first use).
"""

from __future__ import annotations

import errno
import logging
import os
import queue
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..errors import DeepNVMeIOError, ShortTransferError
from .kernel import KernelQueue
from .workers import WorkerGroup

if TYPE_CHECKING:
    from .batch import Items
    from .op import Batch
    from .posix import Posix

__all__ = ["SmallReads", "SMALL_MAX"]

log = logging.getLogger(__name__)

#: the largest read taken here; larger ones go through the window, where reads from locked
#: memory use registered buffers (:data:`deepnvme.io.kernel.FIXED_MIN_BYTES`)
SMALL_MAX = 64 << 10
#: batches take this path (tests switch it off to run the window's gathered path)
ENABLED = True
_MIN_PART = 64  # reads per part at least: a smaller split costs more hand-offs than it saves
_RETRY = (errno.EINTR, errno.EAGAIN)
#: reads submitted per system call at most (0: every free slot in one call). A call holds its
#: reads back until it returns (the block layer plugs them); on this VM's virtual disk a cap of
#: 8 gave Linux AIO 1.10-1.19x the random-read IOPS, but cost the token reader 12-15 % more CPU
#: per sample on the RAM device, where the batching saves system calls: not the default
#: (LOG.md, issue 28)
SUBMIT_MOST = 0


class _Job:
    """One batch on its way: the parts still running, the bytes they read."""

    __slots__ = ("batch", "parts", "total", "posix", "group", "fd", "name")

    def __init__(self, batch: Batch, parts: int, posix: Posix, group: WorkerGroup) -> None:
        self.batch, self.parts, self.total = batch, parts, 0
        self.posix, self.group = posix, group
        self.fd, self.name = batch.fd_direct, batch.transfer.name

    def part_done(self, nbytes: int) -> None:
        """Count a finished part; the last one closes the batch's files and completes it."""
        b = self.batch
        with b.lock:
            self.total += nbytes
            self.parts -= 1
            if self.parts:
                return
        try:
            b.close_fds(self.posix)
        finally:
            keepalive, b.transfer.keepalive = b.transfer.keepalive, None
            if isinstance(keepalive, list):
                keepalive.clear()
            if b.error is not None:
                b.future.set_exception(b.error)
            else:
                b.future.set_result(self.total)
            with self.group.lock:
                self.group.open.discard(b)


class _Part:
    """Reads ``[i]`` of a batch: ``sizes[i]`` bytes at file ``offsets[i]`` into ``addresses[i]``
    (int64 tensors); every size is ``uniform`` if that is not 0, else ``size_list[i]``."""

    __slots__ = ("job", "addresses", "offsets", "sizes", "uniform", "size_list", "nbytes")

    def __init__(self, job: _Job, addresses: torch.Tensor, offsets: torch.Tensor,
                 sizes: torch.Tensor, uniform: int) -> None:
        self.job, self.addresses, self.offsets, self.sizes = job, addresses, offsets, sizes
        self.uniform = uniform
        self.size_list: list[int] = [] if uniform else sizes.tolist()
        self.nbytes = uniform * sizes.numel() if uniform else sum(self.size_list)

    def size(self, i: int) -> int:
        return self.uniform or self.size_list[i]


class SmallReads:
    """The threads and queues that run one kernel mover's small-read batches (see the module
    docstring); ``make_queue(depth)`` makes a thread's queue. Thread-safe."""

    def __init__(self, name: str, make_queue: Callable[[int], KernelQueue], *, depth: int,
                 workers: int, single: bool, posix: Posix, closed_message: str) -> None:
        self.name, self.make_queue, self.depth, self.workers = name, make_queue, depth, workers
        self.single, self.posix = single, posix  # single: one entry per submission call
        self.group = WorkerGroup(name=f"deepnvme-small-{name}", closed_message=closed_message)

    def admit(self, batch: Batch, items: Items, uniform: int) -> None:
        """Run ``batch`` (opened, its reads checked to lie inside the file and to be small,
        aligned and direct; every size ``uniform`` bytes if that is not 0). Raises
        ``RuntimeError`` once closing has begun, or where a thread cannot start."""
        if items.tensors is not None:
            addresses, offsets, sizes = items.tensors
        else:
            addresses, offsets, sizes = (torch.tensor(v, dtype=torch.int64) for v in
                                         (items.addresses, items.offsets, items.sizes))
        n = addresses.numel()
        count = max(1, min(self.workers, n // _MIN_PART))
        group = self.group
        job = _Job(batch, count, self.posix, group)
        bounds = [n * k // count for k in range(count + 1)]
        with group.lock:
            group.check_open()
            group.start(self.workers, _serve, lambda i: (group.queue, self.make_queue, self.depth,
                                                          self.single, self.name))
            group.open.add(batch)
            for lo, hi in zip(bounds, bounds[1:]):
                group.queue.put(_Part(job, addresses[lo:hi], offsets[lo:hi], sizes[lo:hi], uniform))

    def drain(self) -> None:
        """Block until every admitted batch has completed."""
        self.group.drain()

    def close(self) -> None:
        """Refuse new batches, finish the admitted ones, stop the threads (which close their
        queues). Idempotent."""
        self.group.close()


def _serve(work: queue.SimpleQueue[_Part | None], make_queue: Callable[[int], KernelQueue],
           depth: int, single: bool, name: str) -> None:
    """Thread body: run parts on this thread's queue (made on first need) until ``None``."""
    kq: KernelQueue | None = None
    try:
        while (part := work.get()) is not None:
            nbytes = 0
            try:
                if kq is None:
                    kq = make_queue(depth)
                nbytes = _run(kq, part, single)
            except Exception as exc:  # noqa: BLE001 - the batch's error, raised by its future
                if isinstance(exc, OSError):
                    exc = DeepNVMeIOError.from_oserror(exc, op=f"{name} submit", path=part.job.name,
                                                       offset=None, size=None)
                part.job.batch.fail(exc)
                if kq is not None:  # its state is unknown now: the next part gets a new one
                    _close(kq)
                    kq = None
            finally:
                # the part's tensors go before its batch completes: a daemon thread that frees a
                # tensor after the caller was told the batch is done can meet the interpreter's
                # exit there (torch's deallocator takes the GIL back inside a noexcept frame:
                # std::terminate, SIGABRT at exit)
                job, part = part.job, None
                job.part_done(nbytes)
    finally:
        if kq is not None:
            _close(kq)


def _close(kq: KernelQueue) -> None:
    try:
        kq.close()
    except OSError as exc:
        log.error("deepnvme: closing the %s queue failed: %s", kq.name, exc)


def _run(kq: KernelQueue, part: _Part, single: bool = False) -> int:
    """Read ``part`` keeping up to ``kq.depth`` reads in flight (``single``: submitted one per
    system call); returns its bytes (all of them, or 0 once the batch has an error)."""
    job, n = part.job, part.sizes.numel()
    table = kq.table(False, job.fd, part.addresses, part.offsets, part.sizes)
    depth, share, uniform, size_list = kq.depth, kq.small_wait_share, part.uniform, part.size_list
    partial: dict[int, int] = {}  # row -> bytes read so far, for reads that came back short
    nxt = inflight = 0
    batch = job.batch
    while True:
        if nxt < n and batch.error is None:
            k = min(depth - inflight, n - nxt)
            if k > 0:
                kq.prep_rows(table, nxt, k)
                nxt += k
                inflight += k
        if not inflight:
            break
        tags, results = kq.submit_wait(max(1, inflight // share), 1 if single else SUBMIT_MOST)
        inflight -= len(tags)
        if partial or (results.count(uniform) != len(results) if uniform else
                       results != [size_list[t] for t in tags]):
            inflight += _settle(kq, table, part, tags, results, partial)
    return 0 if batch.error is not None else part.nbytes


def _settle(kq: KernelQueue, table: torch.Tensor, part: _Part, tags: list[int],
            results: list[int], partial: dict[int, int]) -> int:
    """Check one round's completions one by one (some were not whole); returns how many
    reads were queued again. An unexpected failure here (the file size check after a short
    read failing ...) becomes the batch's error, never lost reads: the count stays exact."""
    job, again = part.job, 0
    for t, r in zip(tags, results):
        done, size = partial.pop(t, 0), part.size(t)
        if r >= size - done or job.batch.error is not None:
            continue  # whole (or the batch failed: nothing more is read)
        try:
            done = _resumed(kq, part, t, r, done, size)
            if done < 0:
                continue
            if done:
                partial[t] = done
            kq.set_row(table, t, int(part.addresses[t]) + done, size - done,
                       int(part.offsets[t]) + done)
            kq.prep_rows(table, t, 1)
        except Exception as exc:  # noqa: BLE001 - the batch's error, raised by its future
            job.batch.fail(exc)
            continue
        again += 1
    return again


def _resumed(kq: KernelQueue, part: _Part, t: int, r: int, done: int, size: int) -> int:
    """The bytes of read ``t`` done once result ``r`` (not whole) is counted, to read the rest
    of; -1 where it failed the batch (an error, or the end of the file)."""
    job, offset = part.job, int(part.offsets[t])
    if r < 0 and -r in _RETRY:
        return done
    if r < 0:
        job.batch.fail(DeepNVMeIOError.from_oserror(
            OSError(-r, os.strerror(-r)), op=f"read ({kq.name})", path=job.name,
            offset=offset, size=size))
        return -1
    if r == 0 or offset + done + r >= job.posix.file_size(job.fd):
        job.batch.fail(ShortTransferError("unexpected end of file", path=job.name,
                                          offset=offset, size=size, transferred=done + r))
        return -1
    return done + r
