"""The engine: the facade over planned chunked transfers and pluggable movers.

One :class:`~deepnvme.io.op.Op` coordinates each request (see there for its guarantees);
the engine opens its file (:mod:`deepnvme.io.opening`), plans its chunks, and admits it to the
dispatch window (:mod:`deepnvme.io.window`), which hands chunks to the mover's workers through
one work queue and completes requests as their chunks come back. Movers only issue chunks and
report completions: the ``threads`` mover runs one blocking syscall per worker
(:mod:`deepnvme.io.threads`); ``io_uring`` and ``aio`` run
:func:`~deepnvme.io.kernel.kernel_worker`, which keeps ``queue_depth`` chunks in flight per
worker. A :class:`~deepnvme.io.movers.Mover` given as ``mover=`` (cuFile) runs its own call per
chunk on the worker threads instead.

``engine="auto"`` where both io_uring and Linux AIO run gives each request (or batch) the mover
that is fast for it (:mod:`deepnvme.io.choice`: Linux AIO is synchronous for buffered and
file-extending transfers); each mover has its own window and workers, started on first use.
A direct write past the file's end grows the file to its end first (``fallocate``), so every
mover queues it like an overwrite.

Concurrency: ``intra_op_parallelism`` worker threads per mover in use (started on first use). Window: at most
``queue_depth`` chunks handed out per handle with ``threads``, ``queue_depth x
intra_op_parallelism`` with a kernel engine. Bounce memory (only for buffers whose address
O_DIRECT cannot use): at most ``intra_op_parallelism x block_size`` bytes with ``threads``,
``intra_op_parallelism x min(queue_depth, 4) x block_size`` per kernel mover in use.
Descriptors: each request opens and closes its file, except ``keep_open`` requests, which share
the engine's kept descriptors (:mod:`deepnvme.io.kept`: at most its limit of files, closed by
:meth:`Engine.close_files` or :meth:`Engine.close`).
"""

from __future__ import annotations

import atexit
import errno
import logging
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future

from ..config import IOConfig
from ..errors import ConfigError, DeepNVMeIOError, ShortTransferError
from ..memory import pinned
from . import small as _small
from .batch import Items
from .batch import submit_many as _submit_batch
from .choice import Choice, TransferShape, choose
from .kernel import KernelQueue, kernel_worker
from .movers import EngineProbe, Mover, probe_engines, queue_factory, registers_buffers, select_engine, select_movers
from .op import Batch, Op, Transfer
from .opening import Opener
from .plan import Kind, plan_transfer
from .posix import POSIX, Posix
from .small import SMALL_MAX, SmallReads
from .threads import Bounces, thread_worker
from .uring_share import REFUSED
from .window import StartWorkers, Window
from .workers import WorkerGroup

# Transfer is defined in .op, the probes in .movers
__all__ = ["Engine", "Transfer", "EngineProbe", "probe_engines"]

log = logging.getLogger(__name__)
_CLOSED = "this handle/engine is closed; create a new one"


_live_engines: weakref.WeakSet[Engine] = weakref.WeakSet()


class Engine:
    """Executes :class:`Transfer` requests on worker threads; thread-safe.

    Raises :class:`~deepnvme.errors.ConfigError` when the configured engine cannot run here.
    """

    def __init__(self, config: IOConfig, *, posix: Posix = POSIX, mover: Mover | None = None
                 ) -> None:
        self.config = config
        self.posix = posix
        self.mover = mover
        #: the movers in use: one, or (``auto`` with io_uring and Linux AIO) one per transfer
        #: as :func:`~deepnvme.io.choice.choose` says; the first is the default
        self.movers: tuple[str, ...] = ((mover.name,) if mover is not None
                                        else self._choose(config.engine, posix))
        #: the engine in use (``auto`` resolved): "io_uring", "aio" or "threads", or the mover's;
        #: with several :attr:`movers`, the first (the others take the transfers it is slow at)
        self.name = self.movers[0]
        self._bounces = Bounces(config.block_size, config.intra_op_parallelism)
        self._opener = Opener(config, posix)  # also keeps the files of ``keep_open`` requests
        self._windows = {name: _window(config, posix, mover, name, self._bounces)
                         for name in self.movers}
        self._window = self._windows[self.name]
        #: per kernel mover, the threads and queues of small-read batches (:mod:`.small`)
        self._small = {name: SmallReads(name, make, depth=config.queue_depth,
                                        workers=config.intra_op_parallelism,
                                        single=config.single_submit, posix=posix,
                                        closed_message=_CLOSED)
                       for name in self.movers if mover is None
                       for make in (queue_factory(name),) if make is not None}
        self._last_choice: dict[str, Choice] = {}
        #: large transfers of a reused locked buffer may go to io_uring (registered once)
        self._reuse_rule = (len(self.movers) > 1 and "io_uring" in self.movers
                            and registers_buffers())
        self._no_extend: set[int] = set()   # fallocate errnos already logged (see _preallocate)
        _live_engines.add(self)

    @staticmethod
    def _choose(requested: str, posix: Posix) -> tuple[str, ...]:
        """A ``posix`` that replaces the transfer syscalls (fault injection) is only called by
        the thread mover: ``auto`` then means ``threads``, and a kernel engine is refused."""
        kind = type(posix)
        if kind.preadv is Posix.preadv and kind.pwritev is Posix.pwritev:
            movers = select_movers(requested)
            select_engine(requested)  # the one place that logs why auto passed a mover over
            return movers
        if requested not in ("auto", "threads"):
            raise ConfigError(f"engine {requested!r} cannot use {kind.__name__}, which replaces "
                              "preadv/pwritev: only engine 'threads' calls them")
        return ("threads",)

    def mover_for(self, op: Op, *, direct: bool, end: int, largest: int,
                  extending: bool | None = None, reused: bool = False) -> Window:
        """The window of the mover for request (or batch) ``op``, opened and planned:
        ``direct`` if every chunk is on its O_DIRECT descriptor, ``end`` the file offset its
        last byte reaches, ``largest`` its largest chunk in bytes, ``extending`` whether a
        write ends past the file's end (None: one fstat to see), ``reused`` whether its memory
        is a locked buffer that moved data before (:meth:`_reused`).
        With one mover, its window; else :func:`~deepnvme.io.choice.choose`'s. The choice is
        kept per class for :meth:`choices`."""
        if len(self.movers) == 1:
            return self._window
        return self._windows[self._choice(op, direct, end, largest, extending, reused).mover]

    def _choice(self, op: Op, direct: bool, end: int, largest: int, extending: bool | None,
                reused: bool) -> Choice:
        t = op.transfer
        if extending is None:
            extending = False
            if t.write:
                fd = op.fd_direct if op.fd_direct >= 0 else op.fd_buffered
                extending = end > self.posix.file_size(fd)
        choice = choose(TransferShape(write=t.write, direct=direct, extending=extending,
                                      largest=largest, workers=self.config.intra_op_parallelism,
                                      reused=reused), self.movers)
        if self._last_choice.get(choice.transfer) is not choice:
            self._last_choice[choice.transfer] = choice
            log.debug("deepnvme: %s of %s goes to %s (%s)", choice.transfer, t.name,
                      choice.mover, choice.why)
        return choice

    def _reused(self, t: Transfer) -> bool:
        """Whether ``t``'s memory is a locked allocation that moved data before (this transfer
        is counted) and that io_uring has not refused to register; only where io_uring
        registers buffers and is one of several movers."""
        if not self._reuse_rule:
            return False
        found = pinned.count_transfer(t.address, t.size)
        return found is not None and found[1] > 0 and found[0] not in REFUSED

    def _preallocate(self, op: Op) -> bool | None:
        """Grow the file to the end of write ``op`` first, where it extends the file and the
        filesystem allocates ahead (:meth:`Posix.extend`), so the write queues like an
        overwrite: measured on a new 512 MiB file, one worker, Linux AIO 1.8 -> 2.3 GB/s on
        the disk and 2.0 -> 3.5 GB/s on the RAM device (LOG.md, issue 28). Only the range the
        write covers past the old end is allocated (a write far past the end leaves the hole).
        Where it cannot (or a stat fails), the write runs as a file-extending one, as before;
        its own errors then name the file and offset. Returns whether the write still extends
        the file (None where the stat failed)."""
        t = op.transfer
        end = t.file_offset + t.size
        try:
            size = self.posix.file_size(op.fd_direct)
        except OSError:
            return None
        if end <= size:
            return False
        start = max(size, t.file_offset)
        err = self.posix.extend(op.fd_direct, start, end - start)
        if err and err not in self._no_extend:
            self._no_extend.add(err)
            log.debug("deepnvme: writes past the end of %s run as file-extending writes: "
                      "fallocate refused (%s)", t.name, errno.errorcode.get(err, err))
        return bool(err)

    def choices(self) -> dict[str, Choice]:
        """The mover each class of transfer went to so far (with several :attr:`movers`)."""
        return dict(self._last_choice)

    # --- submission ----------------------------------------------------------------------

    def submit(self, transfer: Transfer, *, validate: bool = False, fsync: bool | None = None,
               keep_open: bool = False) -> Future[int]:
        """Start a request; the future's result is the number of bytes moved.

        ``keep_open`` (a path target, CPU memory): use the file's kept descriptors, opening
        and keeping them if needed (:mod:`deepnvme.io.kept`), instead of opening and closing
        it for this request. Errors (open failures included) are set on the future, never
        raised here.
        """
        self._window.check_open()
        t = transfer
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
        window = self._window
        extending = None
        if t.write and op.fd_direct >= 0 and self.mover is None:
            extending = self._preallocate(op)
        if len(self.movers) > 1:
            try:
                window = self.mover_for(
                    op, direct=op.fd_direct >= 0 and all(c.kind is not Kind.BUFFERED
                                                         for c in op.chunks),
                    end=t.file_offset + t.size, largest=max(c.length for c in op.chunks),
                    extending=extending if t.write else False, reused=self._reused(t))
            except BaseException as exc:  # the fstat failed: the request's error
                op.close_fds(self.posix)
                op.future.set_exception(exc)
                return op.future
        window.admit([op], op)
        return op.future

    def submit_many(self, write: bool, target: str, items: Items, *, validate: bool = False,
                    fsync: bool | None = None, keep_open: bool = False) -> Future[int]:
        """Start one request per item, all on file ``target``, opened once (or kept open,
        as :meth:`submit`); see :mod:`deepnvme.io.batch`."""
        if self.mover is not None:
            raise ValueError(f"submit_many is not supported by the {self.name} mover")
        self._window.check_open()
        return _submit_batch(self._opener, self.mover_for, self.config.block_size, write, target,
                             items, validate=validate,
                             fsync=self.config.fsync if fsync is None else fsync,
                             keep_open=keep_open, small=self._small_reads if self._small else None,
                             small_max=SMALL_MAX)

    def _small_reads(self, batch: Batch, items: Items, shape: tuple[int, int, int]) -> bool:
        """Hand a batch of small direct reads to its mover's :class:`SmallReads` (False where
        that path is switched off or the mover chosen is not a kernel mover)."""
        if not _small.ENABLED:
            return False
        end, largest, uniform = shape
        name = (self._choice(batch, True, end, largest, None, False).mover
                if len(self.movers) > 1 else self.name)
        runner = self._small.get(name)
        if runner is None:
            return False
        runner.admit(batch, items, uniform)
        return True

    def close_files(self, paths: Iterable[str] = (), *, under: str | None = None) -> None:
        """Close the descriptors kept open for ``paths`` and for the files under the directory
        ``under`` (those in use once their requests end). Call it before deleting or replacing
        a file used with ``keep_open``. Raises the first close failure, naming the file."""
        self._opener.close_files(paths, under=under)

    def _prepare(self, op: Op, keep_open: bool = False) -> None:
        t = op.transfer
        if t.file_offset < 0:
            raise DeepNVMeIOError("negative file offset", path=t.name, offset=t.file_offset,
                                  size=t.size, errno=errno.EINVAL)
        if keep_open and self.mover is not None:
            raise ValueError(f"keep_open is not supported by the {self.name} mover")
        alignment = self._opener.open(op, keep_open)
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
            op.fd_buffered = self._opener.reopen_buffered(op)

    # --- lifetime ------------------------------------------------------------------------

    def drain(self) -> None:
        """Block until every submitted request has completed (errors stay on their futures)."""
        for window in self._windows.values():
            window.drain()
        for runner in self._small.values():
            runner.drain()

    def close(self) -> None:
        """Refuse new requests, finish the admitted ones, stop the workers and free bounce
        buffers. Idempotent. Not callable from a worker thread (a future's done-callback)."""
        closed = [window.close() for window in self._windows.values()]
        for runner in self._small.values():
            runner.close()
        if not closed[0]:
            return
        try:
            self._opener.close()
        except DeepNVMeIOError as exc:
            log.error("deepnvme: %s", exc)
        self._bounces.close()


def _window(config: IOConfig, posix: Posix, mover: Mover | None, name: str,
            bounces: Bounces) -> Window:
    """The dispatch window of mover ``name`` (its workers start on first use)."""
    make_queue = queue_factory(name) if mover is None else None
    kernel = make_queue is not None
    return Window(config.queue_depth * (config.intra_op_parallelism if kernel else 1), posix,
                  _starter(config, posix, mover, make_queue, bounces), closed_message=_CLOSED,
                  span=config.queue_depth if kernel else 0)


def _starter(config: IOConfig, posix: Posix, mover: Mover | None,
             make_queue: Callable[[int], KernelQueue] | None, bounces: Bounces) -> StartWorkers:
    """How the window starts ``intra_op_parallelism`` workers of this mover (on first use; a
    kernel queue that cannot be set up raises there, in the submitting thread). Holds no
    reference to the engine."""
    n = config.intra_op_parallelism
    if make_queue is None:
        def start_threads(group: WorkerGroup, ref: weakref.ref[Window]) -> None:
            group.start(n, thread_worker, lambda i: (ref, group.queue, posix, bounces.borrow,
                                                     mover))
        return start_threads

    def start_kernel(group: WorkerGroup, ref: weakref.ref[Window]) -> None:
        group.start(n, kernel_worker, lambda i: (ref, group.queue, make_queue(config.queue_depth),
                                                 posix, config.block_size, config.single_submit,
                                                 _close_queue))
    return start_kernel


def _close_queue(kq: KernelQueue) -> None:
    try:
        kq.close()
    except OSError as exc:
        log.error("deepnvme: closing the %s queue failed: %s", kq.name, exc)


@atexit.register
def _drain_at_exit() -> None:
    """Let queued writes reach the file before the interpreter exits (errors are logged)."""
    for engine in list(_live_engines):
        try:
            engine.drain()
        except Exception as exc:  # noqa: BLE001 - reported, never swallowed silently
            log.error("deepnvme: error while draining I/O at exit: %s", exc)
