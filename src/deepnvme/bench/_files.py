"""Files around a measurement: removing what killed deepnvme processes left in a directory
before writing there, and checking that an output file can be written before a long run."""

from __future__ import annotations

import logging
import os
import tempfile

from ..errors import DeepNVMeError, UsageError
from ..io.durable import TempFile, find_temp_files

__all__ = ["run_clean", "remove_leftovers", "check_writable"]

log = logging.getLogger(__name__)


def run_clean(directory: str, *, dry_run: bool = False) -> list[TempFile]:
    """Remove (``dry_run``: only find) stale temporary files in ``directory``; return every
    temporary file found, stale or kept, in name order.

    Saves, bench, tune and report name their temporary files
    ``.<name>.deepnvme-tmp-<pid>-<host>-<random>``; a file whose process (the pid, on this
    machine) no longer exists is stale. Files of running processes and of other machines are
    never removed."""
    if not os.path.isdir(directory):
        raise DeepNVMeError(f"{directory!r} is not a directory; pass the directory to clean")
    found = find_temp_files(directory)
    if not dry_run:
        for entry in found:
            if entry.stale:
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:  # removed meanwhile by another cleaner
                    log.debug("deepnvme clean: %s was already gone", entry.path)
    return found


def remove_leftovers(directories: tuple[str, ...] | list[str]) -> None:
    """Remove stale temporary files from each directory before a run writes there (logged)."""
    for d in dict.fromkeys(directories):
        if not os.path.isdir(d):
            continue  # the run's own checks report a missing directory
        for entry in run_clean(d):
            if entry.stale:
                log.info("removed %s (%s)", entry.path, entry.reason)


def check_writable(path: str, option: str, *, force: bool = True) -> None:
    """Raise :class:`UsageError` unless ``path`` can be written as a file (its folder exists
    and takes new files; it is not a folder; it exists only when ``force``), so a long run
    does not fail at its end. ``option`` names the setting in the message."""
    if os.path.isdir(path):
        raise UsageError(f"{option} {path!r} is a directory; give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise UsageError(f"{option} {path!r}: directory {folder!r} does not exist")
    if os.path.lexists(path) and not force:
        raise UsageError(f"{option} {path!r} already exists; add --force to overwrite it")
    try:
        fd, probe = tempfile.mkstemp(prefix=".deepnvme-probe-", dir=folder)
    except OSError as exc:
        raise UsageError(f"{option} {path!r}: cannot create files in {folder!r} "
                         f"({exc.strerror})") from None
    os.close(fd)
    os.unlink(probe)
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise UsageError(f"{option} {path!r} exists and is not writable")
