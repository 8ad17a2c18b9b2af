"""Text rendering of :class:`~deepnvme.cli.bench_load.LoadBenchResult` (a table for people)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from ._render import GB

if TYPE_CHECKING:
    from .bench_load import LoadBenchResult

__all__ = ["EVICTION_TEXT", "render_load_bench"]

EVICTION_TEXT = {"drop-caches": "sync + drop_caches (whole page cache) before each read",
             "fadvise": "posix_fadvise(DONTNEED) on the files before each read",
             "none": "no eviction (warm on purpose)"}


def _table(result: LoadBenchResult) -> Table:
    n = result.checkpoint.nbytes
    table = Table(title=f"{result.reps} interleaved rep(s)", title_justify="left")
    for name in ("reader", "cache", "GB/s median", "seconds median (min-max)", "x fastest"):
        table.add_column(name, justify="left" if name in ("reader", "cache") else "right")
    for row in result.rows:
        secs = row.seconds
        table.add_row(row.reader, row.cache, f"{row.gbps(n).median:.3f}",
                      f"{secs.median:.4f} ({secs.min:.4f}-{secs.max:.4f})",
                      f"{result.ratio(row):.2f}x")
    return table


def render_load_bench(result: LoadBenchResult, console: Console) -> None:
    """Print the checkpoint line, the table, the notes and ``fastest here: ...`` last."""
    def say(text: str) -> None:
        console.print(text, soft_wrap=True, markup=False)

    c = result.checkpoint
    tensors = max(r.tensors for r in result.rows)
    files = f"{len(c.files)} file{'s' if len(c.files) > 1 else ''}"
    say(f"deepnvme bench load: {c.path} ({c.format}, {files}, {c.nbytes / GB:.3f} GB, "
        f"{tensors} tensors) -> {result.device}")
    say(f"  cold reads: {EVICTION_TEXT.get(result.eviction, result.eviction)}; each row is marked "
        "cold or warm by the bytes mincore finds cached (cold: at most 1 %)")
    say("  timed: the read plus touching every page of every tensor"
        + (" (copied to the GPU, synchronised)" if result.device != "cpu" else "")
        + "; GB = 1e9 bytes; 'x fastest' = the row's median seconds / the fastest's")
    say("  readers: " + ", ".join(f"{r.reader} = {r.call}" for r in result.rows))
    console.print(_table(result))
    for note in result.notes:
        say(f"  note: {note}")
    say(result.headline())
