"""The one background writer of asynchronous saves, and its failure ledger.

A :class:`Job` is "write these staged items into this file, fsync, then commit": the writer
thread reserves the file's blocks, has the staged save write its bytes (:attr:`Staged.write`,
hashing alongside when the job carries a hash), releases the staging memory, then runs the
job's ``commit`` callback with the :class:`Written` result. The callback makes the file
visible: :func:`deepnvme.io.durable.commit` for ``async_save``; manifest, publish and retention
for :class:`~deepnvme.CheckpointManager` (and, across ranks, whatever agreement it needs).
Jobs run one at a time, in submission order, on one daemon thread per saver.

A failed job runs its ``abort`` callback (remove the temporary file or directory; it returns
the error to report) and fails its future. The :class:`Ledger` keeps every failure until a
wait has raised it: the saver's ``wait()`` and next save raise it, ``close()`` logs those
nobody raised. No error is dropped.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..config import IOConfig
from ..handles.aio import AioHandle
from ..io.file import reserve
from ._staging import HashFn, Staged

__all__ = ["Call", "Job", "Ledger", "SaveFuture", "Writer", "Written"]

log = logging.getLogger(__name__)


class SaveFuture(Future[None]):
    """A save's future; ``collected`` once a wait raised its error to a caller."""

    collected = False


@dataclass(frozen=True)
class Written:
    """What the writer hands to a job's commit: the file (fsynced), its checksums by record key
    (empty without a hash) and the seconds spent writing and hashing."""

    file: str
    checksums: dict[str, int]
    write_seconds: float


@dataclass
class Job:
    """Write ``staged`` into ``file``, fsync, then ``commit``. ``check`` (optional) runs on the
    writer thread before any byte is written; ``abort`` cleans up after a failure and returns
    the error to report. ``staged.release()`` runs once the bytes are on disk, whatever happens."""

    file: str
    staged: Staged
    commit: Callable[[Written], None]
    abort: Callable[[BaseException], BaseException]
    hash_fn: HashFn | None = None
    check: Callable[[str], None] | None = None
    future: SaveFuture = field(default_factory=SaveFuture)
    write_seconds: float = 0.0


@dataclass
class Call:
    """Run ``fn`` on the writer thread, in order with the other jobs (a save whose writing and
    agreement the caller's function does itself, e.g. a step of several ranks); its error
    fails the future."""

    fn: Callable[[], None]
    future: SaveFuture = field(default_factory=SaveFuture)


class Writer:
    """Runs :class:`Job` s in order on one daemon thread through one :class:`AioHandle` (made
    from ``config`` when the thread starts). ``submit`` and ``stop`` from any thread."""

    def __init__(self, config: IOConfig, *, name: str) -> None:
        self._handle = AioHandle(config=config)
        self._jobs: queue.SimpleQueue[Job | Call | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job | Call) -> SaveFuture:
        self._jobs.put(job)
        return job.future

    def stop(self) -> None:
        """Finish the queued jobs, end the thread, close the handle (idempotent)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        self._handle.close()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if isinstance(job, Call):
                try:
                    job.fn()
                except BaseException as exc:  # delivered by the saver's wait() / next save
                    job.future.set_exception(exc)
                else:
                    job.future.set_result(None)
                continue
            try:
                self._write(job)
            except BaseException as exc:  # delivered by the saver's wait() / next save
                job.future.set_exception(job.abort(exc))
            else:
                job.future.set_result(None)

    def _write(self, job: Job) -> None:
        start = time.perf_counter()
        try:
            if job.check is not None:
                job.check(job.file)
            reserve(job.file, os.path.getsize(job.file))
            sums = job.staged.write(self._handle, job.file, job.hash_fn)
        finally:
            job.staged.release()
        job.write_seconds = time.perf_counter() - start
        job.commit(Written(job.file, sums, job.write_seconds))


class Ledger:
    """The futures of one saver's saves until each succeeded or its error was raised once.
    Thread-safe."""

    def __init__(self) -> None:
        self._futures: list[SaveFuture] = []
        self._lock = threading.Lock()

    def add(self, future: SaveFuture) -> None:
        with self._lock:
            self._futures = [f for f in self._futures if not _settled(f)] + [future]

    def pending(self) -> list[SaveFuture]:
        """The futures not settled yet (running, or failed and not reported), oldest first."""
        with self._lock:
            return list(self._futures)

    def wait(self) -> None:
        """Block until every save added so far has finished (raises nothing)."""
        for fut in self.pending():
            fut.exception()

    def raise_first(self) -> None:
        """Raise the error of the oldest finished save that no wait has raised yet (and mark it
        raised); the others stay for the next call."""
        with self._lock:
            for fut in self._futures:
                if fut.done() and not fut.collected and (exc := fut.exception()) is not None:
                    fut.collected = True
                    self._futures = [f for f in self._futures if not _settled(f)]
                    raise exc
            self._futures = [f for f in self._futures if not _settled(f)]

    def unreported(self) -> list[BaseException]:
        """Errors of finished saves that no wait raised (for the log at close), marked raised."""
        out = []
        with self._lock:
            for fut in self._futures:
                if fut.done() and not fut.collected and (exc := fut.exception()) is not None:
                    fut.collected = True
                    out.append(exc)
        return out


def _settled(fut: SaveFuture) -> bool:
    """Done, and either succeeded or its error was already raised by a wait."""
    return fut.done() and (fut.exception() is None or fut.collected)
