"""Opening a request's file: O_DIRECT where the file system takes it, else buffered, plus a
buffered descriptor for unaligned edges; or the descriptors kept open for ``keep_open``
requests (:mod:`deepnvme.io.kept`).

A file system that refuses O_DIRECT (``EINVAL`` at open, or no alignment from ``statx``) is
logged once per directory and read buffered: a fallback that says so, never a silent one.
Used by the engine for single requests and by batches (:mod:`deepnvme.io.batch`).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterable

from ..config import IOConfig
from ..errors import DeepNVMeIOError
from .kept import KeptFiles, Opened
from .op import Op
from .plan import Alignment
from .posix import Posix

__all__ = ["Opener"]

log = logging.getLogger(__name__)
_fallback_logged: set[str] = set()


class Opener:
    """Opens files for requests with ``config``'s O_DIRECT and alignment settings through
    ``posix``, and owns the kept descriptors (closed by :meth:`close`). Thread-safe."""

    def __init__(self, config: IOConfig, posix: Posix) -> None:
        self.config = config
        self.posix = posix
        self._kept = KeptFiles(posix)

    def open(self, op: Op, keep_open: bool = False) -> Alignment | None:
        """Open the descriptors a request needs (or take the kept ones, with ``keep_open`` and
        a path) onto ``op``; returns the O_DIRECT alignment or None. A descriptor given as the
        target is used as it is and never closed."""
        t, px = op.transfer, self.posix
        if isinstance(t.target, int):
            if px.is_direct(t.target):
                op.fd_direct = t.target
                return self.alignment(op.fd_direct, t.name)
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
                _log_fallback(path, "open(O_DIRECT) returned EINVAL")
            else:
                try:
                    alignment = self.alignment(fd, path)
                except BaseException:
                    px.close(fd)
                    raise
                if alignment is not None:
                    return fd, -1, alignment
                px.close(fd)
        return -1, px.open(path, write=write, direct=False, offset=offset, size=size, **mode), None

    def alignment(self, fd: int, name: str) -> Alignment | None:
        """The O_DIRECT alignment of descriptor ``fd`` (file ``name``), or None where the file
        system reports no O_DIRECT support (logged once)."""
        try:
            found = self.posix.dio_alignment(fd)
        except OSError:
            _log_fallback(name, "statx reports no O_DIRECT support")
            return None
        if found is None:
            a = self.config.alignment
            return Alignment(memory=a, offset=a)
        return found

    def reopen_buffered(self, op: Op) -> int:
        """A buffered descriptor for a request's unaligned edges (a kept file keeps its own;
        otherwise the request owns and closes it)."""
        t, kept = op.transfer, op.kept
        path = t.target if isinstance(t.target, str) else f"/proc/self/fd/{t.target}"
        if kept is not None:
            return kept.buffered(lambda: self.posix.open(
                path, write=False, direct=False, offset=t.file_offset, size=t.size,
                **({"read_write": True} if kept.writable else {})))
        fd = self.posix.open(path, write=t.write, direct=False, offset=t.file_offset, size=t.size)
        op.owned_fds.append(fd)
        return fd

    def close_files(self, paths: Iterable[str] = (), *, under: str | None = None) -> None:
        """Close the kept descriptors of ``paths`` and of the files under directory ``under``
        (those in use once their requests end). Raises the first close failure, naming it."""
        self._kept.forget(paths, under=under)

    def close(self) -> None:
        """Close every kept descriptor; raises :class:`DeepNVMeIOError` naming a failure."""
        self._kept.close()


def _log_fallback(path: str, why: str) -> None:
    key = os.path.dirname(os.path.abspath(path)) if not path.startswith("<") else path
    if key not in _fallback_logged:
        _fallback_logged.add(key)
        log.warning("deepnvme: buffered I/O instead of O_DIRECT for %s (%s)", key, why)
