"""Shared helpers for rendering CLI results: sizes, statistics, rich consoles and progress bars."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import statistics
import sys
from collections.abc import Iterator, Sequence
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

__all__ = ["Stats", "fmt_size", "stdout_console", "progress_bar", "print_json"]

GB = 1e9  # GB means 1e9 bytes everywhere in deepnvme


@dataclasses.dataclass(frozen=True)
class Stats:
    """min / median / max of a non-empty sequence of numbers."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            raise ValueError("no values to summarise")
        return cls(min(values), statistics.median(values), max(values))

    def to_dict(self) -> dict[str, float]:
        return {"min": self.min, "median": self.median, "max": self.max}


def fmt_size(n: int) -> str:
    """``1073741824`` -> ``"1 GiB"``; exact binary multiples get a suffix, others stay bytes."""
    for shift, suffix in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {suffix}"
    return f"{n} B"


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

