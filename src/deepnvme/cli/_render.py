"""Shared helpers for rendering results: consoles, progress bars, JSON, and the texts several
commands print."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from ..bench._units import GB, fmt_size

__all__ = ["GB", "fmt_size", "stdout_console", "progress_bar", "print_json", "EVICTION_TEXT"]

#: how ``bench load`` and ``bench data`` made their reads cold, as the output says it
EVICTION_TEXT = {"drop-caches": "sync + drop_caches (whole page cache) before each read",
                 "fadvise": "posix_fadvise(DONTNEED) on the files before each read",
                 "none": "no eviction (warm on purpose)"}


def stdout_console() -> Console:
    """Console for tables: the terminal's width, or 100 columns when piped (rich's 80 is narrow)."""
    return Console(highlight=False, soft_wrap=False, width=None if sys.stdout.isatty() else 100)


@contextlib.contextmanager
def progress_bar(description: str, total: float | None, *, enabled: bool = True
                 ) -> Iterator[Progress | None]:
    """A transient progress bar on stderr, shown only when stderr is a terminal."""
    console = Console(stderr=True)
    if not enabled or not console.is_terminal:
        yield None
        return
    columns = [TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=True) as progress:
        progress.add_task(description, total=total)
        yield progress


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
