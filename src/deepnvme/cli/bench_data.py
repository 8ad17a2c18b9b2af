"""``deepnvme bench data PREFIX``: samples/s of a token dataset, deepnvme against mmap readers.

Parses the options into :class:`~deepnvme.bench.DataOptions`, runs
:func:`~deepnvme.bench.run_data_bench` (the method is described in :mod:`deepnvme.bench.data`)
and prints a table or JSON.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from ..bench import DataBenchResult, DataOptions, run_data_bench
from ..bench._data_readers import DATA_READERS
from ..bench._reading import EVICTIONS
from ._args import positive_int
from ._render import EVICTION_TEXT, print_json, progress_bar, stdout_console

__all__ = ["add_bench_data_parser", "render_data_bench", "run_data_bench", "DataOptions",
           "DataBenchResult"]


def add_bench_data_parser(modes: Any) -> None:
    """Register ``deepnvme bench data PREFIX`` on the ``bench`` parser's sub-modes."""
    p = modes.add_parser("data", help="time token-dataset readers on a Megatron .bin/.idx pair",
                         description=__doc__.split("\n\n")[0])
    p.add_argument("prefix", metavar="PREFIX", help="the dataset's path without .bin/.idx")
    p.add_argument("--seq-len", type=positive_int, default=2048, help="tokens per sample minus one (default: 2048)")
    p.add_argument("--batch-size", type=positive_int, default=32, help="samples per batch (default: 32)")
    p.add_argument("--shuffled", type=positive_int, default=4096,
                   help="random samples read in the shuffled pass (default: 4096)")
    p.add_argument("--sequential", type=positive_int, default=16384,
                   help="consecutive samples read in the sequential pass (default: 16384)")
    p.add_argument("--reps", type=positive_int, default=3, help="interleaved repetitions; medians reported")
    p.add_argument("--prefetch", type=positive_int, default=16, help="deepnvme's batches in flight (default: 16)")
    p.add_argument("--readers", default="", metavar="NAME[,NAME...]",
                   help=f"readers to time: {', '.join(DATA_READERS)} (default: every installed one)")
    p.add_argument("--evict", choices=EVICTIONS, default="auto",
                   help="how reads are made cold: drop-caches (root), fadvise (the files), none (warm)")
    p.add_argument("--torch-threads", type=positive_int, default=1,
                   help="torch intra-op threads while timing (default: 1, as in DataLoader workers)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_bench_data, command="bench data")


def _cmd_bench_data(args: Any) -> int:
    names = tuple(dict.fromkeys(n.strip() for n in args.readers.split(",") if n.strip()))
    options = DataOptions(prefix=args.prefix, seq_len=args.seq_len, batch_size=args.batch_size,
                          shuffled=args.shuffled, sequential=args.sequential, reps=args.reps,
                          readers=names, prefetch=args.prefetch, evict=args.evict,
                          torch_threads=args.torch_threads)
    with progress_bar("deepnvme bench data", None) as progress:
        result = run_data_bench(options, progress=progress)
    if args.json:
        print_json(result.to_dict())
    else:
        render_data_bench(result, stdout_console())
    return 0


# --- rendering -------------------------------------------------------------------------

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
