"""Requests on striped files: one plan of part spans, one batch per drive on that drive's
engine, one future for the whole.

Each drive directory gets its own :class:`~deepnvme.io.engine.Engine` (its own workers, queue
and window, started on first use), so every drive has requests in flight at once; the
coordination (chunking, windows, short-transfer retries, fsync, validation) is the engine's.
A request is checked against the file's layout records first (:mod:`deepnvme.io.volume_files`);
a write that grows the file updates them durably before any data moves. A failure of any
part fails the request once every part has ended; the error is the part's own (naming the
part file, on the drive's directory, and the offset in it) with a note giving the drive and
the logical offset. Memory and threads: those of one engine per drive in use.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from ..config import IOConfig
from ..errors import ShortTransferError
from .batch import Items
from .engine import Engine
from .op import Transfer
from .posix import Posix
from .volume import VolumePath, split_ranges
from .volume_files import Layouts

__all__ = ["StripedIO"]


class StripedIO:
    """Striped-file requests over per-drive engines built from ``config`` and ``posix``.
    Thread-safe; :meth:`close` stops every drive's engine."""

    def __init__(self, config: IOConfig, posix: Posix) -> None:
        self.config = config
        self.posix = posix
        self.layouts = Layouts()
        self._engines: dict[str, Engine] = {}
        self._lock = threading.Lock()
        self._closed = False

    def engine(self, directory: str) -> Engine:
        """The engine of the drive at ``directory`` (made on first use)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this handle is closed; create a new one")
            eng = self._engines.get(directory)
            if eng is None:
                eng = self._engines[directory] = Engine(self.config, posix=self.posix)
            return eng

    def reserve(self, vpath: VolumePath, end: int) -> None:
        """Grow (or create) the striped file's layout to ``end`` bytes now, so the requests
        that follow (a staged write's chunks) need no record update each."""
        self.layouts.ensure(vpath, end)

    def submit_many(self, write: bool, vpath: VolumePath, items: Items, *,
                    validate: bool = False, fsync: bool | None = None,
                    keep_open: bool = False) -> Future[int]:
        """Start moving every item (address, size, logical offset) to or from ``vpath``. The
        future's result is the total byte count, or the first failure once every part ended.
        Errors (layout mismatches included) are set on the future, never raised here."""
        out: Future[int] = Future()
        out.set_running_or_notify_cancel()
        try:
            per_drive = self._plan(write, vpath, items)
            futures = [(d, self._submit_part(write, vpath, d, part, validate=validate,
                                             fsync=fsync, keep_open=keep_open,
                                             empty=not sum(items.sizes)))
                       for d, part in enumerate(per_drive) if len(part) or write]
        except BaseException as exc:  # every failure goes to the future
            out.set_exception(exc)
            return out
        _combine(out, vpath, futures, sum(items.sizes))
        return out

    def _submit_part(self, write: bool, vpath: VolumePath, drive: int, part: Items, *,
                     validate: bool, fsync: bool | None, keep_open: bool,
                     empty: bool) -> Future[int]:
        eng = self.engine(vpath.volume.paths[drive])
        if len(part):
            return eng.submit_many(write, vpath.part(drive), part, validate=validate,
                                   fsync=fsync, keep_open=keep_open)
        if not empty:  # a write touching other drives only: nothing to do on this one
            done: Future[int] = Future()
            done.set_result(0)
            return done
        # a zero-byte write (a staged write's closing fsync): open and fsync every part
        return eng.submit(Transfer(write=True, address=0, size=0, target=vpath.part(drive)),
                          fsync=fsync, keep_open=keep_open)

    def _plan(self, write: bool, vpath: VolumePath, items: Items) -> list[Items]:
        vol = vpath.volume
        end = max((o + s for o, s in zip(items.offsets, items.sizes)), default=0)
        if write:
            self.layouts.ensure(vpath, end)
        else:
            size = self.layouts.current(vpath).size
            for o, s in zip(items.offsets, items.sizes):
                if o + s > size:
                    raise ShortTransferError.past_end(path=str(vpath), offset=o, size=s,
                                                      file_size=size)
        return [Items(a, s, o, items.keepalive)
                for a, s, o in split_ranges(items.addresses, items.sizes, items.offsets,
                                            drives=len(vol.paths), stripe=vol.stripe)]

    def close_files(self, paths: Iterable[VolumePath], *, under: str | None = None) -> None:
        """Close kept descriptors of the parts of ``paths``, and of files under ``under``."""
        with self._lock:
            engines = dict(self._engines)
        by_dir: dict[str, list[str]] = {}
        for vpath in paths:
            for d, directory in enumerate(vpath.volume.paths):
                by_dir.setdefault(directory, []).append(vpath.part(d))
        for directory, eng in engines.items():
            eng.close_files(by_dir.get(directory, ()), under=under)

    def drain(self) -> None:
        with self._lock:
            engines = list(self._engines.values())
        for eng in engines:
            eng.drain()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            engines = list(self._engines.values())
        for eng in engines:
            eng.close()


def _combine(out: Future[int], vpath: VolumePath, futures: Sequence[tuple[int, Future[int]]],
             total: int) -> None:
    """Complete ``out`` with ``total`` once every part future ended, or with the first drive's
    failure (in drive order), noted with the drive and the striped file."""
    if not futures:
        out.set_result(total)
        return
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future[int]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        for d, fut in futures:
            exc = fut.exception()
            if exc is not None:
                _note(exc, vpath, d)
                out.set_exception(exc)
                return
        out.set_result(total)

    for _, fut in futures:
        fut.add_done_callback(one_done)


def _note(exc: BaseException, vpath: VolumePath, drive: int) -> None:
    stripe, n = vpath.volume.stripe, vpath.drives
    where = f"striped file {vpath.name!r}: volume drive {drive} of {n} " \
            f"({vpath.volume.paths[drive]}), part file {vpath.part(drive)!r}"
    offset: Any = getattr(exc, "offset", None)
    if isinstance(offset, int):
        unit, within = divmod(offset, stripe)
        where += f", part offset {offset} = logical offset {(unit * n + drive) * stripe + within}"
    add_note = getattr(exc, "add_note", None)  # Python 3.11+; before, the message stands alone
    if add_note is not None:
        add_note(where)

