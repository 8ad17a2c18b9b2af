"""``deepnvme bench``: how fast is my storage path? (DeepSpeed's ds_io, with honest numbers).

Parses the ds_io-style flags into :class:`~deepnvme.bench.BenchOptions`, runs
:func:`~deepnvme.bench.run_bench` (the method is described in :mod:`deepnvme.bench.storage`)
and prints its tables or JSON. ``bench load`` and ``bench data`` are modes of this command.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from ..bench import BenchOptions, BenchResult, OpStats, run_bench
from ..bench._engines import parse_engines
from ..config import resolve_config
from ..errors import ConfigError
from ._args import nonnegative_int, positive_int, positive_size
from ._render import fmt_size, print_json, progress_bar, stdout_console
from .bench_data import add_bench_data_parser
from .bench_load import add_bench_load_parser

__all__ = ["parse_dir_map", "add_bench_parser", "render_bench", "run_bench", "BenchOptions"]


def parse_dir_map(text: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """``"/nvme0:0,/nvme1:1"`` -> (dirs, gpu ids). A directory may itself contain ``:``."""
    dirs, gpus = [], []
    for item in filter(None, (s.strip() for s in text.split(","))):
        d, sep, g = item.rpartition(":")
        if not sep or not d or not g.isdigit():
            raise ConfigError(f"--dir-map entry {item!r} is not DIR:GPU (e.g. /mnt/nvme0:0)")
        dirs.append(d)
        gpus.append(int(g))
    if not dirs:
        raise ConfigError("--dir-map is empty; give DIR:GPU[,DIR:GPU...]")
    return tuple(dirs), tuple(gpus)


def add_bench_parser(subparsers: Any) -> None:
    """Register ``deepnvme bench`` (flags mirror DeepSpeed's ds_io)."""
    b = subparsers.add_parser(
        "bench", help="measure write (to stable storage) and cold read GB/s, like ds_io",
        description=__doc__.split("\n\n")[0])
    b.add_argument("--dir", action="append", default=None, metavar="DIR",
                   help="directory for the temporary files (repeatable; default: .)")
    b.add_argument("--dir-map", default=None, metavar="DIR:GPU,...",
                   help="directories with the GPU each one feeds (several devices)")
    b.add_argument("--io-size", type=positive_size, default=1 << 30, metavar="SIZE",
                   help="bytes per transfer and process, K/M/G suffixes (default: 1G)")
    b.add_argument("--read", action="store_true", help="measure reads (default: reads and writes)")
    b.add_argument("--write", action="store_true", help="measure writes (default: both)")
    b.add_argument("--block-size", type=positive_size, default=None, metavar="SIZE",
                   help="bytes per chunk/syscall (default: 1M or DEEPNVME_BLOCK_SIZE)")
    b.add_argument("--queue-depth", type=positive_int, default=None, metavar="N",
                   help="chunks in flight per handle (default: 128); also fio's --iodepth")
    b.add_argument("--parallelism", type=positive_int, default=None, metavar="N",
                   help="intra_op_parallelism: I/O threads per handle")
    b.add_argument("--engine", default=None, metavar="NAME[,NAME...]",
                   help="deepnvme's I/O engines to sweep, one row each: auto, io_uring, aio, "
                        "threads (default: auto, or DEEPNVME_ENGINE)")
    b.add_argument("--random", action="store_true",
                   help="random reads: every --random-size block of the --io-size file once per "
                        "loop, in random order; IOPS, MB/s, latency")
    b.add_argument("--random-size", type=positive_size, default=None, metavar="SIZE",
                   help="bytes per random read: 4K to 64K in steps of 4K (default: 4K)")
    b.add_argument("--single-submit", action="store_true",
                   help="submit chunks one per call (io_uring/aio), as ds_io's")
    b.add_argument("--sequential-requests", action="store_true",
                   help="accepted for ds_io parity (overlap_events=False)")
    b.add_argument("--loops", type=positive_int, default=3, help="timed loops (default: 3)")
    b.add_argument("--warmup-loops", type=nonnegative_int, default=1, help="untimed loops first (default: 1)")
    b.add_argument("--validate", action="store_true", help="check every byte written and read")
    b.add_argument("--procs", type=positive_int, default=1,
                   help="processes at once, barrier-synchronised, one file each")
    b.add_argument("--gpu", action="store_true", help="GPU buffers (staged through host memory)")
    b.add_argument("--gds", action="store_true", help="GPUDirect Storage")
    b.add_argument("--compare", action="store_true",
                   help="also time plain Python file I/O and fio on the same files (with "
                        "--random: fio randread)")
    b.add_argument("--json", action="store_true", help="print JSON instead of tables")
    b.set_defaults(func=_cmd_bench)
    modes = b.add_subparsers(dest="bench_mode", metavar="{load PATH,data PREFIX}",
                             help="time checkpoint readers on PATH, or token-dataset readers on PREFIX, instead")
    add_bench_load_parser(modes)
    add_bench_data_parser(modes)


def _random_size(args: Any) -> int | None:
    if not args.random:
        if args.random_size is not None:
            raise ConfigError("--random-size applies to random reads: add --random")
        return None
    return 4096 if args.random_size is None else int(args.random_size)


def _cmd_bench(args: Any) -> int:
    if args.dir and args.dir_map:
        raise ConfigError("give either --dir or --dir-map, not both")
    dirs, gpus = parse_dir_map(args.dir_map) if args.dir_map else (tuple(args.dir or ["."]), ())
    both = not (args.read or args.write)
    config = resolve_config({"block_size": args.block_size, "queue_depth": args.queue_depth,
                             "intra_op_parallelism": args.parallelism})
    options = BenchOptions(dirs=dirs, gpus=gpus, io_size=args.io_size, read=both or args.read,
                           write=args.write or (both and not args.random), config=config,
                           engines=() if args.engine is None else parse_engines(args.engine),
                           random_size=_random_size(args),
                           single_submit=args.single_submit,
                           sequential_requests=args.sequential_requests, procs=args.procs,
                           loops=args.loops, warmup=args.warmup_loops, validate=args.validate,
                           compare=args.compare, gpu=args.gpu, gds=args.gds)
    with progress_bar("deepnvme bench", None) as progress:
        result = run_bench(options, progress=progress)
    if args.json:
        print_json(result.to_dict())
    else:
        render_bench(result, stdout_console())
    return 0


# --- rendering -------------------------------------------------------------------------

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
