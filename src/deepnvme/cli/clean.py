"""``deepnvme clean DIR``: remove the temporary files killed deepnvme processes left in DIR.

Saves, bench, tune and report all name their temporary files
``.<name>.deepnvme-tmp-<pid>-<host>-<random>``; a file whose process (the pid, on this
machine) no longer exists is litter. Files of running processes and of other machines are
never removed. ``bench`` and ``tune`` call :func:`remove_leftovers` on their directories first.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from ..errors import DeepNVMeError
from ..io.durable import TempFile, find_temp_files

__all__ = ["run_clean", "remove_leftovers", "add_clean_parser"]

log = logging.getLogger(__name__)


def run_clean(directory: str, *, dry_run: bool = False) -> list[TempFile]:
    """Remove (``dry_run``: only find) stale temporary files in ``directory``; return every
    temporary file found, stale or kept, in name order."""
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


def _clean(args: argparse.Namespace) -> int:
    found = run_clean(args.directory, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    stale = [e for e in found if e.stale]
    for entry in found:
        print(f"{verb if entry.stale else 'kept'} {entry.path} ({entry.reason})")
    print(f"{verb} {len(stale)} temporary file{'' if len(stale) == 1 else 's'} "
          f"in {os.path.abspath(args.directory)}")
    return 0


_DESCRIPTION = """\
Remove the temporary files that killed deepnvme processes left in DIR.

Saves, bench, tune and report name their temporary files
.<name>.deepnvme-tmp-<pid>-<host>-<random>; a file whose process (the pid, on this machine)
no longer exists is litter. Files of running processes and of other machines are never
removed. bench, tune and the first save in a directory clean it the same way."""


def add_clean_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``deepnvme clean``."""
    c: argparse.ArgumentParser = subparsers.add_parser(
        "clean", help="remove temporary files left by killed deepnvme processes",
        description=_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("directory", metavar="DIR", help="directory to clean (not recursive)")
    c.add_argument("--dry-run", action="store_true",
                   help="list what would be removed; remove nothing")
    c.set_defaults(func=_clean)
    return c
