"""Text rendering of :class:`~deepnvme.cli.bench_data.DataBenchResult` (a table for people)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from ._bench_load_view import EVICTION_TEXT

if TYPE_CHECKING:
    from .bench_data import DataBenchResult

__all__ = ["render_data_bench"]


def _table(result: DataBenchResult) -> Table:
    reps = result.options.reps
    table = Table(title=f"{reps} interleaved rep(s); medians (min-max)", title_justify="left")
    for name in ("order", "reader", "cache", "samples/s", "GB/s", "deepnvme / reader"):
        table.add_column(name, justify="left" if name in ("order", "reader", "cache") else "right")
    for row in result.rows:
        sps = row.samples_per_s
        deepnvme = next((r for r in result.rows if r.order == row.order and r.reader == "deepnvme"), None)
        ratio = result.ratio(deepnvme, row.reader) if deepnvme is not None else None
        table.add_row(row.order, row.reader, row.cache, f"{sps.median:,.0f} ({sps.min:,.0f}-{sps.max:,.0f})",
                      f"{row.gbps.median:.3f}", "" if ratio is None else f"{ratio:.2f}x")
    return table


def render_data_bench(result: DataBenchResult, console: Console) -> None:
    """Print the dataset line, the table, the notes and the deepnvme ratios last."""
    def say(text: str) -> None:
        console.print(text, soft_wrap=True, markup=False)

    o = result.options
    first = result.rows[0]
    say(f"deepnvme bench data: {result.dataset} (seq_len {o.seq_len}, {first.sample_bytes} bytes a sample, "
        f"batches of {o.batch_size}; shuffled: {o.shuffled} random samples, sequential: "
        f"{o.sequential} consecutive)")
    say(f"  cold reads: {EVICTION_TEXT.get(result.eviction, result.eviction)}; each row is marked cold or "
        "warm by the bytes mincore finds cached (cold: at most 1 %)")
    say("  timed: every batch made as a [batch, seq_len + 1] int64 tensor and summed; GB = 1e9 bytes; "
        f"torch threads: {o.torch_threads}")
    say("  readers: " + "; ".join(f"{r.reader} = {r.call}" for r in result.rows if r.order == first.order))
    console.print(_table(result))
    for note in result.notes:
        say(f"  note: {note}")
