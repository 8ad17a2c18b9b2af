"""Swap directory ownership: one private subdirectory per swapper, stale ones detected.

A swapper never writes into the user's directory itself: it creates
``<directory>/deepnvme-swap-<pid>-<token>`` holding an ``owner.json`` (host, pid, process start
time). A directory whose owner process no longer exists on this host (or whose pid was reused by
a later process) is left over from a crashed run: it is *stale*. Pure helpers plus small file ops.

The directory is built as ``.deepnvme-swap-creating-<pid>-<token>`` and renamed once its owner
file is inside, so another process looking for stale directories never sees a swap directory
without its owner. A ``creating`` directory older than :data:`CREATING_GRACE_S` was left by a
crash during creation and is stale too.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import shutil
import socket
import time
import warnings
from dataclasses import dataclass

from ..errors import SwapError
from ..io.durable import publish_dir

__all__ = ["PREFIX", "CREATING_PREFIX", "OWNER_FILE", "Owner", "create_private_dir", "find_stale_dirs",
           "handle_stale_dirs", "make_dirs", "remove_dir", "remove_made_dirs"]

log = logging.getLogger(__name__)
PREFIX = "deepnvme-swap-"
CREATING_PREFIX = ".deepnvme-swap-creating-"
CREATING_GRACE_S = 60.0
"""Seconds after which a directory still being created counts as abandoned (creation takes ms)."""
OWNER_FILE = "owner.json"


@dataclass(frozen=True)
class Owner:
    """Who created a swap directory: enough to tell whether that process still runs."""

    host: str
    pid: int
    start_ticks: int | None  # field 22 of /proc/<pid>/stat: tells a reused pid apart


def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read().decode(errors="replace")
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after the last ')'
    fields = stat[stat.rfind(")") + 2:].split()
    return int(fields[19]) if len(fields) > 19 else None


def current_owner() -> Owner:
    return Owner(host=socket.gethostname(), pid=os.getpid(), start_ticks=_start_ticks(os.getpid()))


def owner_alive(owner: Owner, *, host: str | None = None) -> bool:
    """True unless the owner is certainly gone (a directory from another host counts as alive)."""
    if owner.host != (host or socket.gethostname()):
        return True
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    if owner.start_ticks is not None:
        now = _start_ticks(owner.pid)
        if now is not None and now != owner.start_ticks:
            return False  # the pid was reused by a newer process
    return True


def read_owner(path: str) -> Owner | None:
    try:
        with open(os.path.join(path, OWNER_FILE), encoding="utf-8") as f:
            data = json.load(f)
        return Owner(host=str(data["host"]), pid=int(data["pid"]),
                     start_ticks=None if data.get("start_ticks") is None else int(data["start_ticks"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find_stale_dirs(directory: str) -> list[str]:
    """Swap subdirectories of ``directory`` whose owner process is gone (sorted paths).

    A directory without a readable owner file counts as stale (a crash while creating it).
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    stale = []
    for name in sorted(names):
        path = os.path.join(directory, name)
        if not name.startswith((PREFIX, CREATING_PREFIX)) or not os.path.isdir(path):
            continue
        if name.startswith(CREATING_PREFIX):
            try:
                age = time.time() - os.stat(path).st_mtime
            except FileNotFoundError:
                continue  # renamed into place (or removed) meanwhile
            if age > CREATING_GRACE_S:
                stale.append(path)
            continue
        owner = read_owner(path)
        if owner is None or not owner_alive(owner):
            stale.append(path)
    return stale


def handle_stale_dirs(directory: str, stale: str) -> list[str]:
    """Find the stale swap directories in ``directory`` and act on them as ``stale`` says:
    ``"warn"`` (a warning), ``"remove"`` (delete them) or ``"error"`` (raise SwapError)."""
    found = find_stale_dirs(directory)
    if not found:
        return found
    msg = (f"deepnvme: {len(found)} stale swap director{'y' if len(found) == 1 else 'ies'} "
           f"from a crashed run in {directory}: {found}")
    if stale == "error":
        raise SwapError(msg + "; delete them or pass stale='remove'", path=directory,
                        offset=None, size=None, errno=errno.EEXIST)
    if stale == "remove":
        for path in found:
            remove_dir(path)
        log.warning("%s: removed", msg)
    else:
        # stacklevel 3: the user's line that created the swapper
        warnings.warn(msg + "; pass stale='remove' to delete them", RuntimeWarning,
                      stacklevel=3)  # the warning only: not also a log line
    return found


def make_dirs(directory: str) -> tuple[str, ...]:
    """Create ``directory`` and its missing parents; return those this call created, outermost
    first (a directory another process created meanwhile is not among them)."""
    missing = []
    path = os.path.abspath(directory)
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    made: list[str] = []
    try:
        for path in reversed(missing):
            try:
                os.mkdir(path)
            except FileExistsError:
                continue
            made.append(path)
    except BaseException:
        remove_made_dirs(tuple(made))
        raise
    return tuple(made)


def remove_made_dirs(made: tuple[str, ...]) -> None:
    """Remove the directories :func:`make_dirs` created, innermost first, while they are empty:
    one holding anything (another swapper's directory, a user's file) stays, with its parents."""
    for path in reversed(made):
        try:
            os.rmdir(path)
        except FileNotFoundError:
            continue
        except OSError:   # not empty (or not ours to remove any more): keep it and its parents
            return


def create_private_dir(directory: str) -> str:
    """Create and return a fresh swap subdirectory of ``directory`` (which is created if missing)."""
    os.makedirs(directory, exist_ok=True)
    owner = current_owner()
    name = f"{owner.pid}-{secrets.token_hex(4)}"
    creating = os.path.join(directory, CREATING_PREFIX + name)
    os.mkdir(creating, 0o700)
    try:
        with open(os.path.join(creating, OWNER_FILE), "w", encoding="utf-8") as f:
            json.dump({"host": owner.host, "pid": owner.pid, "start_ticks": owner.start_ticks}, f)
        path = os.path.join(directory, PREFIX + name)
        publish_dir(creating, path)  # appears, durably, with its owner file inside
    except BaseException:
        remove_dir(creating)
        raise
    return path


def remove_dir(path: str) -> None:
    """Remove a swap directory and everything in it; a missing directory is fine."""
    shutil.rmtree(path, ignore_errors=True)
    if os.path.exists(path):
        log.error("deepnvme: could not remove swap directory %s completely", path)
