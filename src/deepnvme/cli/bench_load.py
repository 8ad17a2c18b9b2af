"""``deepnvme bench load PATH``: which checkpoint reader is fastest on this checkpoint, here?

Parses the options into :class:`~deepnvme.bench.LoadOptions`, runs
:func:`~deepnvme.bench.run_load_bench` (the method is described in :mod:`deepnvme.bench.load`)
and prints a table ending with the fastest reader, or JSON.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.table import Table

from ..bench import LoadBenchResult, LoadOptions, run_load_bench
from ..bench._load_readers import READERS
from ..bench._reading import EVICTIONS
from ._args import positive_int
from ._render import EVICTION_TEXT, GB, print_json, progress_bar, stdout_console

__all__ = ["add_bench_load_parser", "render_load_bench", "run_load_bench", "LoadOptions"]


def _reader_names(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    unknown = [n for n in names if n not in READERS]
    if unknown or not names:
        what = ", ".join(unknown) if unknown else repr(text)
        raise argparse.ArgumentTypeError(f"unknown reader(s) {what}; choose from {', '.join(READERS)}")
    return names


def add_bench_load_parser(modes: Any) -> None:
    """Register ``deepnvme bench load PATH`` on the ``bench`` parser's sub-modes."""
    p = modes.add_parser("load", help="time checkpoint readers on your own checkpoint",
                         description=__doc__.split("\n\n")[0])
    p.add_argument("path", metavar="PATH",
                   help=".safetensors file, torch.save file, or Hugging Face model directory")
    p.add_argument("--reps", type=positive_int, default=3,
                   help="interleaved repetitions; medians are reported (default: 3)")
    p.add_argument("--readers", type=_reader_names, default=(), metavar="NAME[,NAME...]",
                   help=f"readers to time: {', '.join(READERS)} (default: all that read the format)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where results end up; cuda copies every tensor to the GPU (default: cpu)")
    p.add_argument("--evict", choices=EVICTIONS, default="auto",
                   help="how reads are made cold: drop-caches (root: the whole page cache), "
                        "fadvise (the files only), none (warm); auto: drop-caches as root")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_cmd_bench_load, command="bench load")  # errors: "deepnvme bench load: ..."


def _cmd_bench_load(args: Any) -> int:
    options = LoadOptions(path=args.path, readers=args.readers, reps=args.reps,
                          device=args.device, evict=args.evict)
    with progress_bar("deepnvme bench load", None) as progress:
        result = run_load_bench(options, progress=progress)
    if args.json:
        print_json(result.to_dict())
    else:
        render_load_bench(result, stdout_console())
    return 0


# --- rendering -------------------------------------------------------------------------

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
