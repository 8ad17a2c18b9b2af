"""``deepnvme.async_save``: checkpoint without stopping training for the disk.

The caller's thread only takes a snapshot (:class:`~._staging.SnapshotStager`): every storage is
copied (by parallel ``memmove``) into a locked, 4096-aligned staging arena while PyTorch writes
the zip skeleton to the temporary file, so the file holds the values of the call's moment,
whatever training does next. The background writer (:mod:`._writer`) then writes the arena
with O_DIRECT, fsyncs and atomically renames, as :func:`deepnvme.save`.

Memory bound: ``max_in_flight`` arenas, each as large as the largest checkpoint saved so far
(sum of its storages, each rounded up to 4096 bytes). Arenas are reused across saves; a save
that finds no free arena waits for the oldest save in flight to finish.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Mapping
from typing import Any

from ..config import IOConfig, checkpoint_config
from ..io import durable
from ._paths import as_path
from ._staging import SnapshotStager
from ._writer import Job, Ledger, SaveFuture, Writer, Written

__all__ = ["AsyncCheckpointer", "AsyncSaveHandle", "async_save"]

log = logging.getLogger(__name__)


class AsyncSaveHandle:
    """The pending result of one asynchronous save (thread-safe)."""

    def __init__(self, path: str, future: SaveFuture) -> None:
        self.path = path
        self._future = future

    def done(self) -> bool:
        """True once the file is durable under its final name, or the save failed."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is durable; re-raise its error. ``TimeoutError`` after ``timeout`` s."""
        exc = self._future.exception(timeout)
        if exc is not None:
            self._future.collected = True
            raise exc

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"AsyncSaveHandle({self.path!r}, {state})"


class AsyncCheckpointer:
    """Runs asynchronous saves on one background writer thread, with reusable staging arenas.

    ``save()`` blocks only for the snapshot (and, when ``max_in_flight`` saves are already
    pending, until the oldest finishes). Close it (or use it as a context manager) to wait for
    pending saves, stop the thread and free the arenas.
    """

    def __init__(self, *, max_in_flight: int = 1,
                 config: IOConfig | Mapping[str, Any] | None = None) -> None:
        if isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be >= 1, got {max_in_flight}")
        self.config = checkpoint_config(config)
        self.max_in_flight = max_in_flight
        self._stager = SnapshotStager(arenas=max_in_flight)
        self._writer: Writer | None = None
        self._lock = threading.Lock()
        self._ledger = Ledger()
        self._last: dict[str, SaveFuture] = {}  # the newest save to each path still in flight
        self._closed = False

    def save(self, obj: Any, path: str | os.PathLike[str], *, recycle: bool = False
             ) -> AsyncSaveHandle:
        """Snapshot ``obj`` now and write it to ``path`` in the background.

        ``recycle``: as for :func:`deepnvme.save` (overwrite ``path``'s spare file, keep the
        replaced file as the next spare).
        """
        path = durable.resolve_target(as_path(path, "deepnvme.async_save"))
        with self._lock:
            if self._closed:
                raise RuntimeError("AsyncCheckpointer is closed")
            if self._writer is None:
                self._writer = Writer(self.config, name="deepnvme-async-save")
            writer = self._writer
        durable.check_target_dir(path)
        if recycle and (before := self._last.get(path)) is not None:
            before.exception()  # its commit makes the spare this save overwrites
        tmp = (durable.take_spare(path) if recycle else None) or durable.temp_name(path, clean=not recycle)
        try:
            staged = self._stager.stage(obj, tmp)  # waits while max_in_flight saves are pending
        except BaseException:
            durable.remove_quietly(tmp)
            raise

        def commit(written: Written) -> None:
            durable.commit(tmp, path, fsync_file=False, keep_spare=recycle)

        def abort(exc: BaseException) -> BaseException:
            durable.remove_quietly(tmp)
            return exc

        job = Job(file=tmp, staged=staged, commit=commit, abort=abort)
        with self._lock:
            if self._closed:  # close() ran during the snapshot: the writer thread is gone
                staged.release()
                durable.remove_quietly(tmp)
                raise RuntimeError("AsyncCheckpointer was closed while this save was starting")
            # failed saves stay until a wait raised their error (wait_all/close report them)
            self._ledger.add(job.future)
            self._last = {p: f for p, f in self._last.items() if not f.done()} | {path: job.future}
            writer.submit(job)
        return AsyncSaveHandle(path, job.future)

    def wait_all(self) -> None:
        """Block until every save started so far has finished; raise the first failure whose
        error no wait has raised yet (a later ``wait_all()`` or ``close()`` reports the others)."""
        self._ledger.wait()
        self._ledger.raise_first()

    def close(self) -> None:
        """Wait for pending saves (errors not waited for are logged), stop, free arenas."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            writer = self._writer
        self._ledger.wait()
        for exc in self._ledger.unreported():
            log.error("deepnvme: asynchronous save failed and was never waited for: %s", exc)
        if writer is not None:
            writer.stop()
        self._stager.close()

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_default: AsyncCheckpointer | None = None
_default_lock = threading.Lock()


def _close_default() -> None:
    if _default is not None:
        _default.close()


def async_save(obj: Any, path: str | os.PathLike[str], *,
               config: IOConfig | Mapping[str, Any] | None = None, recycle: bool = False
               ) -> AsyncSaveHandle:
    """Start saving ``obj`` to ``path`` (torch.save format) and return at once with a handle.

    Blocks only to snapshot the tensors into a reused staging arena (one save in flight: a
    second call first waits for the previous save). ``handle.wait()`` re-raises any error.
    The process waits for pending saves at exit. ``config`` is used when the shared background
    checkpointer is first created; make an :class:`AsyncCheckpointer` for other settings.
    ``recycle`` is as for :func:`deepnvme.save`.
    """
    global _default
    with _default_lock:
        if _default is None or _default._closed:
            _default = AsyncCheckpointer(config=config)
            atexit.register(_close_default)
    return _default.save(obj, path, recycle=recycle)
