"""The one-writer lock of a checkpoint directory: ``fcntl.flock`` on ``<dir>/.deepnvme-writer.lock``.

The kernel drops a flock when its holder's descriptor closes, so a killed writer never leaves
the directory locked. The file holds the holder's pid and host for the error message only.
"""

from __future__ import annotations

import fcntl
import os
import socket

from ..errors import CheckpointLockedError

__all__ = ["LOCK_NAME", "DirectoryLock", "try_lock"]

LOCK_NAME = ".deepnvme-writer.lock"


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


def try_lock(directory: str) -> DirectoryLock:
    """Lock ``directory`` for writing; :class:`CheckpointLockedError` naming the holder if
    another live process (or another manager in this one) holds it."""
    path = os.path.join(directory, LOCK_NAME)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "an unknown process"
        os.close(fd)
        raise CheckpointLockedError(
            f"checkpoint directory {directory!r} is locked by another writer ({holder}); one "
            f"CheckpointManager may save into a directory at a time (readers need no lock). "
            f"Close the other manager or use another directory") from None
    except BaseException:
        os.close(fd)
        raise
    text = f"pid {os.getpid()} on {socket.gethostname()}\n".encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, text, 0)
    return DirectoryLock(fd, path)
