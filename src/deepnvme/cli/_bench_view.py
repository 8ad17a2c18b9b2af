"""Text rendering of :class:`~deepnvme.cli.bench.BenchResult` (tables for people)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from ._render import fmt_size

if TYPE_CHECKING:
    from .bench import BenchResult, OpStats

__all__ = ["render_bench"]


def _ratio_cell(result: BenchResult, op: OpStats, per_task: bool) -> str:
    """deepnvme's (first engine's) median rate over this row's; blank on that row itself."""
    r = result.ratio(op, per_task=per_task)
    return "" if r is None else f"{r:.2f}x"


def _table(result: BenchResult, title: str, per_task: bool) -> Table:
    compare = result.compared
    table = Table(title=title, title_justify="left")
    table.add_column("op")
    table.add_column("tool")
    table.add_column("engine")
    table.add_column("GB/s median (min-max)", justify="right")
    table.add_column("latency ms median (min-max)", justify="right")
    if compare:
        table.add_column("deepnvme is", justify="right")
    for op in result.ops:
        rate = op.task_gbps if per_task else op.e2e_gbps
        lat = op.task_latency if per_task else op.e2e_latency
        row = [op.op, op.tool, op.engine or "-",
               f"{rate.median:.3f} ({rate.min:.3f}-{rate.max:.3f})",
               f"{lat.median * 1e3:.1f} ({lat.min * 1e3:.1f}-{lat.max * 1e3:.1f})"]
        if compare:
            row.append(_ratio_cell(result, op, per_task))
        table.add_row(*row)
    return table


def _random_table(result: BenchResult) -> Table:
    compare = result.compared
    table = Table(title=f"random reads of {fmt_size(result.random_size or 0)}, all processes",
                  title_justify="left")
    for name in ("tool", "engine", "IOPS (min-max)", "MB/s", "latency us (min-max)"):
        table.add_column(name, justify="left" if name in ("tool", "engine") else "right")
    if compare:
        table.add_column("deepnvme is", justify="right")
    for op in result.ops:
        iops, lat = op.iops, op.read_latency
        row = [op.tool, op.engine or "-", f"{iops.median:,.0f} ({iops.min:,.0f}-{iops.max:,.0f})",
               f"{op.mbps.median:.1f}",
               f"{lat.median * 1e6:.0f} ({lat.min * 1e6:.0f}-{lat.max * 1e6:.0f})"]
        if compare:
            row.append(_ratio_cell(result, op, per_task=False))
        table.add_row(*row)
    return table


def _settings(result: BenchResult) -> str:
    c = result.config
    mode = "O_DIRECT" if result.o_direct else "buffered + page-cache eviction"
    gpu = (", GPU buffers via cuFile (GdsHandle)" if result.gds
           else ", GPU buffers staged through pinned memory" if result.gpu else "")
    return (f"  deepnvme: engine {', '.join(result.engines)}, block_size {fmt_size(c.block_size)}, "
            f"queue_depth {c.queue_depth}, intra_op_parallelism {c.intra_op_parallelism}, "
            f"{mode}, buffers {'page-locked' if result.pinned else 'NOT page-locked'}{gpu}")


def render_bench(result: BenchResult, console: Console) -> None:
    """Print the settings lines, the result table(s) and the notes."""
    def say(text: str) -> None:
        console.print(text, soft_wrap=True, markup=False)

    where = ", ".join(f"{d} ({fs})" for d, fs in zip(result.dirs, result.filesystems))
    procs = f"{result.procs} process{'es' if result.procs > 1 else ''}"
    say(f"deepnvme bench: {procs} x {fmt_size(result.io_size)} ({result.io_size / 1e9:.3f} GB) "
        f"each, in {where}")
    say(_settings(result))
    if result.random_size:
        say(f"  {result.loops} loop(s) after {result.warmup} warm-up; each loop reads every "
            f"{fmt_size(result.random_size)} block once in random order, cold; medians over "
            "the loops; MB = 1e6 bytes")
        console.print(_random_table(result))
    else:
        say(f"  {result.loops} loop(s) after {result.warmup} warm-up; writes timed until fsync "
            "returns (new file each time), reads cold; GB = 1e9 bytes")
        title = "end-to-end (all processes of a step)" if result.procs > 1 else "per transfer"
        console.print(_table(result, title, per_task=False))
        if result.procs > 1:
            console.print(_table(result, "per process (task)", per_task=True))
    if result.compared:
        say(f"  'deepnvme is' = deepnvme ({result.engines[0]})'s median rate / the row's "
            "(2.00x = twice as fast)")
    if result.validated is not None:
        say(f"  {_validated(result)}")
    for note in result.notes:
        say(f"  note: {note}")


def _validated(result: BenchResult) -> str:
    """The --validate line: how many transfers were compared with the written data."""
    writes, reads = result.validated or (0, 0)
    what = (f"{reads} random-read passes (every {fmt_size(result.random_size)} block)"
            if result.random_size else f"{writes} writes and {reads} reads")
    skipped = " (fio's transfers are not checked)" if "fio" in result.tools else ""
    return (f"validated: {what} of {fmt_size(result.io_size)} compared byte-for-byte against "
            f"the written data, warm-up included{skipped}")
