"""The one-writer lock of a checkpoint directory: ``fcntl.flock`` on ``<dir>/.deepnvme-writer.lock``.

The kernel drops a flock when its holder's descriptor closes, so a killed writer never leaves
the directory locked. The file holds the holder's pid and host for the error message, and
marks a holder that only removes leftovers (a manager opening the directory, possibly a reader):
a writer waits for such a holder instead of failing, so readers may open the directory at any
time, even while the writer takes the lock at its first save. Only a writer creates the
directory and the lock file; opening a manager to read creates nothing (:func:`tidy`).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Callable

from ...errors import CheckpointLockedError
from ._steps import remove_leftovers

__all__ = ["LOCK_NAME", "DirectoryLock", "tidy", "try_lock"]

log = logging.getLogger(__name__)

LOCK_NAME = ".deepnvme-writer.lock"
TIDYING = "(removing leftovers)"  # ends the holder text of a lock taken only to remove leftovers
_GRACE = 0.5  # seconds a writer retries any holder: one that just took the lock has not named itself yet


class DirectoryLock:
    """An exclusive, non-blocking lock of one directory, held until :meth:`release`."""

    def __init__(self, fd: int, path: str) -> None:
        self._fd: int | None = fd
        self.path = path

    def release(self) -> None:
        """Unlock (idempotent)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor drops the flock


def try_lock(directory: str, *, tidying: bool = False, tidy_wait: float = 600.0) -> DirectoryLock:
    """Lock ``directory``; :class:`CheckpointLockedError` naming the holder if another live
    process (or another manager in this one) holds it.

    ``tidying``: the lock is wanted only to remove leftovers; one attempt. Otherwise (a writer,
    which creates ``directory`` and the lock file if missing), a holder that is tidying is waited
    for (up to ``tidy_wait`` seconds; removing a large leftover can take seconds), and any holder
    for :data:`_GRACE` seconds.
    """
    path = os.path.join(directory, LOCK_NAME)
    if not tidying:
        os.makedirs(directory, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    return _acquire(fd, path, directory, tidying=tidying, tidy_wait=tidy_wait)


def tidy(directory: str, *, remove: Callable[[], object] | None = None) -> None:
    """Remove leftovers of killed saves in ``directory`` if no writer holds it; creates nothing.
    ``remove``: what removes them instead of :func:`remove_leftovers` (a manager on a volume
    removes those of every drive).

    Leftovers exist only where a writer once held the lock, so a directory or lock file that
    does not exist (or that this process may not write) has none to remove here."""
    path = os.path.join(directory, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return
    except OSError as exc:
        if exc.errno == errno.EROFS:   # a read-only copy of the checkpoints: nothing to tidy
            return
        raise
    try:
        lock = _acquire(fd, path, directory, tidying=True, tidy_wait=0.0)
    except CheckpointLockedError:
        return  # a live writer owns the directory and its hidden directories
    try:
        if remove is None:
            remove_leftovers(directory)
        else:
            remove()
    finally:
        lock.release()


def _acquire(fd: int, path: str, directory: str, *, tidying: bool, tidy_wait: float) -> DirectoryLock:
    """Flock the open lock file ``fd`` as :func:`try_lock` says (closes ``fd`` on failure)."""
    start = time.monotonic()
    logged = False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "an unknown process"
                waited = time.monotonic() - start
                if tidying or not (waited < _GRACE or (holder.endswith(TIDYING) and waited < tidy_wait)):
                    raise CheckpointLockedError(
                        f"checkpoint directory {directory!r} is locked by another writer ({holder}); one "
                        f"CheckpointManager may save into a directory at a time (readers need no lock). "
                        f"Close the other manager or use another directory") from None
                if holder.endswith(TIDYING) and not logged:
                    log.info("deepnvme.CheckpointManager: waiting for %s to finish removing leftovers "
                             "in %s", holder, directory)
                    logged = True
                time.sleep(0.01)
    except BaseException:
        os.close(fd)
        raise
    text = f"pid {os.getpid()} on {socket.gethostname()}{' ' + TIDYING if tidying else ''}\n".encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, text, 0)
    return DirectoryLock(fd, path)
