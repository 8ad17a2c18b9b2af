"""The ``deepnvme`` parser and its argument checks: a bad value is one line on stderr and exit 2.

Values are checked when parsed (sizes and counts must be positive), so a mistake is reported
before anything is allocated or measured; :class:`UsageError` is for checks that need more
than one value or the system (a device, an optional package, a path).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import NoReturn

from ..config import parse_size
from ..errors import ConfigError, UsageError

__all__ = ["UsageError", "CliParser", "positive_int", "nonnegative_int", "positive_size",
           "positive_float", "check_writable"]


class CliParser(argparse.ArgumentParser):
    """argparse's parser, but a bad argument is one line (``deepnvme bench: error: ...``)
    instead of the usage block, so the mistake is the first thing read."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None


def positive_int(text: str) -> int:
    """A count that must be at least 1 (loops, processes, queue depth ...)."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def nonnegative_int(text: str) -> int:
    """A count that may be 0 (warm-up loops, prefetched blocks)."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_size(text: str) -> int:
    """A byte size with an optional K/M/G/T suffix, at least 1 byte."""
    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    try:
        value = parse_size(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 byte, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A number of seconds (or similar) that must be above 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def check_writable(path: str, option: str, *, force: bool = True) -> None:
    """Raise :class:`UsageError` unless ``path`` can be written as a file (its folder exists
    and takes new files; it is not a folder; it exists only when ``force``), so a long run
    does not fail at its end."""
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
