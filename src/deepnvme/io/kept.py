"""Descriptors kept open between requests on the same files (``keep_open=True``).

Why: opening a file costs a path lookup, ``open(2)``, ``statx(2)`` for its O_DIRECT alignment
and a ``close(2)`` per request. A workload that moves the same files over and over (parameter
offload reads and writes each parameter's file several times a step) asks the engine to keep
them open instead: one entry per path, its descriptors (O_DIRECT where the file system takes
it, a buffered one for unaligned edges opened on first need) and its alignment.

An entry is opened read-write (``O_RDWR``; a write request also creates the file, a read request
never does); a file that cannot be opened for writing (read-only file or mount) is kept
read-only for reads, and a write request on it opens its own descriptors (failing as it would
without ``keep_open``). Descriptors are ``O_CLOEXEC``. In a forked child nothing is reused: a
request there opens its own descriptors (the parent's table is left alone).

Bound: at most ``limit`` files kept (:func:`default_limit`: a quarter of the soft
``RLIMIT_NOFILE``, at most 4096); when full, the least recently used entry that no request is
using is closed; when every entry is in use, the request opens its own descriptors.
Lifetime: an entry closes on :meth:`KeptFiles.forget`, on :meth:`KeptFiles.close` or when
evicted; one in use closes when its last request ends, and no new request gets it meanwhile.
Each reuse checks (``fstat``) that the file still has a name: one deleted or renamed over since it
was opened is dropped and the path opened again, so a request never reaches a file that the
path no longer names (a deleted file then fails as it would without ``keep_open``). Forget a
file before deleting it anyway, to close its descriptor at once.
Thread-safety: one lock; opens happen outside it.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable

from ..errors import DeepNVMeIOError
from .plan import Alignment
from .posix import Posix

__all__ = ["KeptFile", "KeptFiles", "Opened", "default_limit"]

log = logging.getLogger(__name__)

#: what an opener returns: (O_DIRECT descriptor or -1, buffered descriptor or -1, alignment or
#: None when O_DIRECT is not used)
Opened = tuple[int, int, Alignment | None]
#: ``opener(path, write, read_write)`` opens a file as a request would (raising its error)
Opener = Callable[[str, bool, bool], Opened]

_READ_ONLY_ERRORS = (errno.EACCES, errno.EROFS, errno.EPERM)


def default_limit() -> int:
    """Files kept open per engine: a quarter of the soft descriptor limit, 16 to 4096."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft // 4))


class KeptFile:
    """One kept file. ``users`` requests hold it; ``dropped`` once forgotten or evicted (it
    then closes when ``users`` reaches 0). Fields change under the table's lock."""

    __slots__ = ("path", "fd_direct", "fd_buffered", "alignment", "writable", "users",
                 "dropped", "table")

    def __init__(self, table: KeptFiles, path: str, opened: Opened, *, writable: bool) -> None:
        self.table = table
        self.path = path
        self.fd_direct, self.fd_buffered, self.alignment = opened
        self.writable = writable
        self.users = 0
        self.dropped = False

    def release(self) -> None:
        """A request that held this file ended; raises :class:`DeepNVMeIOError` (naming the
        file) if closing a dropped entry failed."""
        self.table._release(self)

    def buffered(self, open_buffered: Callable[[], int]) -> int:
        """The buffered descriptor, opened once with ``open_buffered`` on first need."""
        return self.table._buffered(self, open_buffered)


class KeptFiles:
    """The kept files of one engine (see the module doc)."""

    def __init__(self, posix: Posix, *, limit: int | None = None) -> None:
        self.posix = posix
        self.limit = default_limit() if limit is None else int(limit)
        if self.limit < 1:
            raise ValueError(f"limit must be >= 1, got {self.limit}")
        self._lock = threading.Lock()
        self._files: OrderedDict[str, KeptFile] = OrderedDict()   # least recently used first
        self._pid = os.getpid()
        self._closed = False
        self.opened = 0   # files opened into the table (for tests and statistics)

    def __len__(self) -> int:
        with self._lock:
            return len(self._files)

    def __contains__(self, path: object) -> bool:
        with self._lock:
            return path in self._files

    def acquire(self, path: str, write: bool, opener: Opener) -> KeptFile | None:
        """The kept entry for ``path``, held for one request (:meth:`KeptFile.release` when it
        ends), opened with ``opener`` if not kept yet; None when the request must open its own
        descriptors (table full of files in use, closed, a forked child, or a write to a file
        kept read-only). Open failures raise, as the opener does."""
        if os.getpid() != self._pid:
            return None
        with self._lock:
            kept = self._files.get(path)
            if kept is not None:
                if write and not kept.writable:
                    return None
                self._files.move_to_end(path)
                kept.users += 1
            elif self._closed:
                return None
        if kept is not None:
            if self._still_named(kept):
                return kept
            self.forget([path])    # deleted or replaced: the path names another file, or none
            kept.release()
        opened, writable = self._open(path, write, opener)
        evicted: KeptFile | None = None
        with self._lock:
            kept = self._files.get(path)
            room = kept is None and not self._closed and self._room()
            if room:
                evicted = self._evict()
                kept = KeptFile(self, path, opened, writable=writable)
                self._files[path] = kept
                self.opened += 1
                kept.users += 1
        if evicted is not None:
            self._close_evicted(evicted)
        if room:
            return kept
        # another thread kept the file meanwhile, or no room: these descriptors are not needed
        self._close_fds(path, opened)
        return self.acquire(path, write, opener) if kept is not None else None

    def forget(self, paths: Iterable[str] = (), *, under: str | None = None) -> None:
        """Close the entries of ``paths`` and of every file under the directory ``under`` (ones
        in use once their requests end). Raises the first close failure, naming its file."""
        prefix = None if under is None else os.path.join(os.path.abspath(under), "")
        with self._lock:
            victims = [self._files.pop(p) for p in paths if p in self._files]
            if prefix is not None:
                victims += [self._files.pop(p) for p in list(self._files)
                            if os.path.abspath(p).startswith(prefix)]
            idle = self._drop(victims)
        self._close_all(idle)

    def close(self) -> None:
        """Close every entry (ones in use once their requests end) and keep no more."""
        with self._lock:
            self._closed = True
            victims = list(self._files.values())
            self._files.clear()
            idle = self._drop(victims)
        self._close_all(idle)

    def _still_named(self, kept: KeptFile) -> bool:
        """False if the kept file was deleted or renamed over since it was opened."""
        fd = kept.fd_direct if kept.fd_direct >= 0 else kept.fd_buffered
        try:
            return self.posix.link_count(fd) > 0
        except OSError:
            return False

    # --- internals (``_drop``, ``_room`` and ``_evict`` run under the lock) ---------------------

    def _open(self, path: str, write: bool, opener: Opener) -> tuple[Opened, bool]:
        try:
            return opener(path, write, True), True
        except DeepNVMeIOError as exc:
            if write or exc.errno not in _READ_ONLY_ERRORS:
                raise
        return opener(path, False, False), False   # readable only: kept for reads

    @staticmethod
    def _drop(victims: list[KeptFile]) -> list[KeptFile]:
        """Mark ``victims`` dropped; return those no request uses (to close now)."""
        idle = []
        for kept in victims:
            kept.dropped = True
            if kept.users == 0:
                idle.append(kept)
        return idle

    def _room(self) -> bool:
        """True if one more entry fits, once :meth:`_evict` closed an idle one if full."""
        return len(self._files) < self.limit or any(k.users == 0 for k in self._files.values())

    def _evict(self) -> KeptFile | None:
        """If full, take out the least recently used entry no request uses (closed by the
        caller, outside the lock)."""
        if len(self._files) < self.limit:
            return None
        for path, kept in self._files.items():
            if kept.users == 0:
                del self._files[path]
                kept.dropped = True
                return kept
        return None

    def _close_evicted(self, kept: KeptFile) -> None:
        """Close an entry evicted to make room; a failure is logged (naming the file), not
        raised into the unrelated request that made room."""
        try:
            self._close_fds(kept.path, (kept.fd_direct, kept.fd_buffered, None))
        except DeepNVMeIOError as exc:
            log.error("deepnvme: closing a file kept open failed: %s", exc)

    def _release(self, kept: KeptFile) -> None:
        with self._lock:
            kept.users -= 1
            close = kept.dropped and kept.users == 0
        if close:
            self._close_all([kept])

    def _buffered(self, kept: KeptFile, open_buffered: Callable[[], int]) -> int:
        with self._lock:
            if kept.fd_buffered >= 0:
                return kept.fd_buffered
        fd = open_buffered()
        with self._lock:
            if kept.fd_buffered < 0:
                kept.fd_buffered = fd
                return fd
        self.posix.close(fd)   # another request opened it meanwhile
        return kept.fd_buffered

    def _close_all(self, entries: list[KeptFile]) -> None:
        first: BaseException | None = None
        for kept in entries:
            try:
                self._close_fds(kept.path, (kept.fd_direct, kept.fd_buffered, None))
            except DeepNVMeIOError as exc:
                first = first or exc
        if first is not None:
            raise first

    def _close_fds(self, path: str, opened: Opened) -> None:
        first: OSError | None = None
        for fd in opened[:2]:
            if isinstance(fd, int) and fd >= 0:
                try:
                    self.posix.close(fd)
                except OSError as exc:
                    first = first or exc
        if first is not None:
            raise DeepNVMeIOError.from_oserror(first, op="close (kept open)", path=path,
                                               offset=None, size=None)
