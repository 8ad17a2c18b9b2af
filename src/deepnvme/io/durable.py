"""Durable, atomic replacement of a file: temporary name in the same directory, fsync, rename, fsync dir.

The one module that replaces files and publishes directories: checkpoints, DCP, the CLI's JSON
output, inference's packed weights and manifests, and swap directories all go through it.

Temporary files are named ``.<final name>.deepnvme-tmp-<pid>-<host>-<random>`` (``<host>``: 8 hex
digits naming this machine's pid namespace, so a directory shared between machines is safe).
They are removed after success and after any exception, KeyboardInterrupt included; only a
crash (SIGKILL, power loss) can leave one behind. :func:`clean_temp_files` removes those whose
writing process, on this machine, no longer exists; every save, bench or tune cleans its
directory when it names its temporary file (a directory listing, cheap next to the write), so a
long-running writer also clears what a process killed after its first save left there.
The ``deepnvme`` command's bench, tune and report files use the same names.

Replacing a file frees the old file's blocks, which is slow on filesystems mounted with
``discard`` (a fraction of a second per GiB). :func:`commit` keeps the
old file open across the rename and closes it on a background thread, so the blocks are freed
after the new file is already durable and the caller has moved on; :func:`wait_for_releases`
waits for that clean-up (benchmarks use it so one save's clean-up is not timed in the next).

Recycling (opt-in, ``recycle=True`` on the save functions): the replaced file is kept as
``.<final name>.deepnvme-spare`` and becomes the next save's temporary file, so that save
overwrites allocated, written blocks instead of filling new ones, and nothing is freed. It
costs a second copy of the checkpoint on disk; delete the spare at any time to get it back.
Whatever still reads or maps the replaced file (a ``torch.load(mmap=True)`` result) sees its
bytes change when the next save overwrites the spare, so recycling is for paths nobody maps.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import logging
import os
import queue
import re
import secrets
import stat
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

from ..errors import FileNotFoundIOError, PermissionIOError

__all__ = ["atomic_target", "commit", "fsync_dir", "temp_name", "create_temp", "clean_temp_files",
           "find_temp_files", "TempFile", "resolve_target", "check_target_dir",
           "wait_for_releases", "spare_name", "take_spare", "write_json", "publish_dir",
           "remove_quietly", "fsync_path"]

log = logging.getLogger(__name__)
# <host> is absent from names written before it was added: those are judged by pid alone
_TMP_RE = re.compile(r"^\.(?P<final>.+)\.deepnvme-tmp-(?P<pid>\d+)-(?:(?P<host>[0-9a-f]{8})-)?"
                     r"[0-9a-f]+$")


@functools.cache
def host_tag() -> str:
    """8 hex digits naming this pid namespace: boot id, pid-namespace inode and hostname.

    Two machines sharing a directory (NFS, Lustre) get different tags, so neither judges the
    other's temporary files by a pid that means nothing on its side.
    """
    parts = [os.uname().nodename]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError as exc:  # no /proc: the hostname alone tells machines apart
        log.debug("deepnvme: host tag from the hostname only (%s)", exc)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:8]


def temp_name(path: str, *, clean: bool = True) -> str:
    """A fresh temporary path next to ``path`` (same directory, so rename is atomic).

    With ``clean`` (a save starting), also removes the temporary files that dead processes left
    in that directory (:func:`clean_temp_files`; a live process's files are kept); a failure
    to clean is logged, never raised.
    """
    directory, base = os.path.split(os.path.abspath(path))
    if clean:
        _clean(directory)
    return os.path.join(directory, f".{base}.deepnvme-tmp-{os.getpid()}-{host_tag()}-"
                                   f"{secrets.token_hex(4)}")


def create_temp(directory: str, stem: str) -> str:
    """Create a new empty file named like a save's temporary file for ``stem`` in ``directory``.

    Used by the command line (bench, tune, report) so one cleaner handles every leftover.
    """
    while True:
        path = temp_name(os.path.join(directory, stem))
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))
        except FileExistsError:
            continue
        return path


def resolve_target(path: str) -> str:
    """The file a save to ``path`` must replace: the end of the symlink chain when ``path`` is
    a symlink (``torch.save`` writes through symlinks and so do we), else ``path`` itself."""
    return os.path.realpath(path) if os.path.islink(path) else path


def _clean(directory: str) -> None:
    try:
        removed = clean_temp_files(directory)
    except OSError as exc:
        log.debug("deepnvme: could not look for stale temporary files in %s: %s", directory, exc)
        return
    for path in removed:
        log.info("deepnvme: removed %s, left by a process that no longer exists", path)


def check_target_dir(path: str) -> None:
    """Raise :class:`~deepnvme.errors.FileNotFoundIOError` (a ``FileNotFoundError``) naming
    ``path`` if its directory is missing, :class:`~deepnvme.errors.PermissionIOError` if that
    directory is not writable."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundIOError(f"cannot save: directory {directory!r} does not exist",
                                  path=path, offset=None, size=None, errno=errno.ENOENT)
    if not os.access(directory, os.W_OK | os.X_OK):
        raise PermissionIOError(f"cannot save: no permission to create files in {directory!r}",
                                path=path, offset=None, size=None, errno=errno.EACCES)


def fsync_dir(directory: str) -> None:
    """fsync a directory so a rename or create inside it is durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def spare_name(path: str) -> str:
    """Where ``commit(..., keep_spare=True)`` keeps the file it replaced: ``.<name>.deepnvme-spare``."""
    directory, base = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{base}.deepnvme-spare")


def take_spare(path: str) -> str | None:
    """Rename ``path``'s spare file, if there is one, to a fresh temporary name and return that.

    The next save then overwrites blocks that are already allocated and written, which is
    faster than filling a new file. None when there is no spare (or a
    concurrent save took it first). Cleans the directory as :func:`temp_name` does.
    """
    tmp = temp_name(path)
    try:
        os.rename(spare_name(path), tmp)
    except FileNotFoundError:
        return None
    return tmp


def _keep_as_spare(path: str) -> bool:
    """Give the regular file at ``path`` a second name, its spare, replacing an older spare.

    False when there is no regular file there, or it cannot be linked (it is freed instead).
    """
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return False
    except FileNotFoundError:
        return False
    link = temp_name(path, clean=False)
    try:
        os.link(path, link)
    except OSError as exc:  # e.g. a filesystem without hard links: save without recycling
        log.warning("deepnvme: cannot keep %s as a spare (%s); it is freed instead", path, exc)
        return False
    older = _hold_regular_file(spare_name(path))
    try:
        os.replace(link, spare_name(path))
    except BaseException:
        remove_quietly(link)
        raise
    finally:
        if older is not None:
            _releaser.release(older)
    return True


def commit(tmp: str, path: str, *, fsync_file: bool = True, keep_spare: bool = False) -> None:
    """Make ``tmp`` durable and atomically visible as ``path`` (fsync file, rename, fsync dir).

    A regular file replaced at ``path`` is freed in the background (see the module docstring),
    or, with ``keep_spare``, kept under :func:`spare_name` for the next save to overwrite.
    """
    if fsync_file:
        fsync_path(tmp)
    kept = keep_spare and _keep_as_spare(path)
    old = None if kept else _hold_regular_file(path)  # a kept file has its spare name: no free
    try:
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
    finally:
        if old is not None:
            _releaser.release(old)


def _hold_regular_file(path: str) -> int | None:
    """A read-only descriptor of the regular file at ``path`` (None if there is none to hold)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return None  # no file, a symlink, or unreadable: the rename frees nothing we can defer
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    return None


class _Releaser:
    """Closes descriptors of replaced files on one daemon thread (started on first use)."""

    def __init__(self) -> None:
        self._queue: queue.Queue[int] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def release(self, fd: int) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="deepnvme-release",
                                                daemon=True)
                self._thread.start()
        self._queue.put(fd)

    def _run(self) -> None:
        while True:
            fd = self._queue.get()
            try:
                _close_released(fd)
            except OSError as exc:
                log.error("deepnvme: closing a replaced checkpoint file failed: %s", exc)
            finally:
                self._queue.task_done()

    def wait(self) -> None:
        self._queue.join()


def _close_released(fd: int) -> None:
    os.close(fd)  # the last reference: the kernel frees the replaced file's blocks here


_releaser = _Releaser()


def _fresh_releaser_after_fork() -> None:
    # a forked child has the parent's queue but not its thread: start over (the inherited
    # descriptors close at the child's exit)
    global _releaser
    _releaser = _Releaser()


os.register_at_fork(after_in_child=_fresh_releaser_after_fork)


def wait_for_releases() -> None:
    """Block until every file replaced by a commit so far has been freed."""
    _releaser.wait()


def remove_quietly(path: str) -> None:
    """Remove a temporary file; a failure is logged (never silently ignored)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.error("deepnvme: could not remove temporary file %s: %s", path, exc)


@contextlib.contextmanager
def atomic_target(path: str, *, recycle: bool = False) -> Iterator[str]:
    """Yield a temporary path; on normal exit commit it to ``path``, on an exception remove it.

    The previous file at ``path`` (if any) is untouched until the final rename; when ``path``
    is a symlink, the file it points to is replaced and the link stays. With
    ``recycle``, the temporary file is ``path``'s spare when there is one (its old bytes are
    still there: the writer must overwrite or truncate them) and the replaced file becomes the
    next spare.
    """
    path = resolve_target(path)
    check_target_dir(path)
    tmp = (take_spare(path) if recycle else None) or temp_name(path, clean=not recycle)
    try:
        yield tmp
        commit(tmp, path, keep_spare=recycle)
    except BaseException:
        remove_quietly(tmp)
        raise



def write_json(path: str, data: Any, *, indent: int | None = None) -> None:
    """Replace ``path`` with ``data`` as JSON (temporary name, fsync, rename, fsync dir); a
    failure leaves any previous file untouched. For small files (manifests, tuned configs)."""
    text = json.dumps(data, indent=indent) + ("\n" if indent is not None else "")
    with atomic_target(path) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)


def publish_dir(building: str, path: str) -> None:
    """Make the fully written directory ``building`` appear as ``path`` in one rename, with its
    files fsynced first and the parent directory fsynced after (``path`` must not exist)."""
    for name in os.listdir(building):
        full = os.path.join(building, name)
        if os.path.isfile(full):
            fsync_path(full)
    fsync_dir(building)
    os.rename(building, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


class TempFile(NamedTuple):
    """A deepnvme temporary file found in a directory, and whether it may be removed."""

    path: str
    pid: int
    stale: bool  # its writer is gone: the pid is dead on this machine
    reason: str  # why it is stale or kept, for ``deepnvme clean``


def find_temp_files(directory: str | os.PathLike[str]) -> list[TempFile]:
    """Every deepnvme temporary file in ``directory``, each judged stale or kept (sorted)."""
    directory = os.fspath(directory)
    found = []
    here = host_tag()
    for name in sorted(os.listdir(directory)):
        m = _TMP_RE.match(name)
        if m is None:
            continue
        pid, host = int(m.group("pid")), m.group("host")
        path = os.path.join(directory, name)
        if host is not None and host != here:
            found.append(TempFile(path, pid, False, f"written on another machine ({host})"))
        elif _pid_alive(pid):
            found.append(TempFile(path, pid, False, f"process {pid} is running"))
        else:
            found.append(TempFile(path, pid, True, f"process {pid} no longer exists"))
    return found


def clean_temp_files(directory: str | os.PathLike[str], *, dry_run: bool = False) -> list[str]:
    """Remove temporary files left in ``directory`` by killed deepnvme processes; return their paths.

    Only files whose writer (the pid in the name) no longer exists on this machine are
    removed, so a save or benchmark in progress is never disturbed. ``dry_run``: remove
    nothing, return what would be removed.
    """
    removed = []
    for entry in find_temp_files(directory):
        if not entry.stale:
            continue
        if not dry_run:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:  # another cleaner was first
                continue
        removed.append(entry.path)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
