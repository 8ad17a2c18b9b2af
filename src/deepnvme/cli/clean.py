"""``deepnvme clean DIR``: remove the temporary files killed deepnvme processes left in DIR.

Finds the temporary files with ``run_clean`` (the rule of :func:`deepnvme.clean_temp_files`)
and prints one line per file (removed or kept, and why), then the count.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from ..bench._files import remove_leftovers, run_clean

__all__ = ["run_clean", "remove_leftovers", "add_clean_parser"]


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
removed. bench, tune and saves clean a directory the same way before writing there."""


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
