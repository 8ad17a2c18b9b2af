"""Files around a measurement: removing what killed deepnvme processes left in a directory
before writing there, and checking that an output file can be written before a long run."""

from __future__ import annotations

import logging
import os
import tempfile

from ..errors import DeepNVMeError, UsageError
from ..io.durable import TempFile, clean_temp_files, find_temp_files

__all__ = ["run_clean", "remove_leftovers", "check_writable"]

log = logging.getLogger(__name__)


def run_clean(directory: str, *, dry_run: bool = False) -> list[TempFile]:
    """Remove (``dry_run``: only find) stale temporary files in ``directory``; return every
    temporary file found, stale or kept, in name order, each with the reason.

    The rule is :func:`~deepnvme.io.durable.clean_temp_files`': only files whose writer (the
    pid in the name) no longer runs on this machine are removed."""
    if not os.path.isdir(directory):
        raise DeepNVMeError(f"{directory!r} is not a directory; pass the directory to clean")
    found = find_temp_files(directory)
    if not dry_run:
        clean_temp_files(directory)
    return found


def remove_leftovers(directories: tuple[str, ...] | list[str]) -> None:
    """Remove stale temporary files from each directory before a run writes there (logged)."""
    for d in dict.fromkeys(directories):
        if os.path.isdir(d):  # else the run's own checks report the missing directory
            for path in clean_temp_files(d):
                log.info("removed %s, left by a killed deepnvme process", path)


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
