"""``deepnvme bench``: how fast is my storage path? (DeepSpeed's ds_io, with honest numbers).

Writes go to a new file and are timed until ``fsync`` returns (stable storage); reads are cold
(O_DIRECT, and the file's pages are dropped from the page cache before every read). Each
process moves ``io_size`` bytes per step; ``--procs N`` runs N barrier-synchronised processes.
Latencies are seconds per transfer; rates are GB/s with 1 GB = 1e9 bytes. *Task* figures are
per process, *end-to-end* (e2e) figures cover all processes of a step, from the first start
to the last finish (the same as task with one process). ``--compare`` times plain Python
file I/O and fio on the same files in the same loops (see :mod:`deepnvme.cli._measure`).
``--engine a,b`` runs deepnvme once per I/O engine in the same loops, one row each.

``--random`` measures random reads instead: every ``--random-size`` block of an ``--io-size``
file once per loop, in random order, ``--queue-depth`` reads in flight per worker thread
(:meth:`~deepnvme.AioHandle.read_many`), cold (O_DIRECT, pages dropped before each loop);
IOPS, MB/s (1 MB = 1e6 bytes) and the mean latency of one read. ``--compare`` runs fio
``--rw=randread`` next to it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from ..config import IOConfig, resolve_config
from ..errors import ConfigError, DeepNVMeError
from ._args import nonnegative_int, positive_int, positive_size
from ._bench_setup import check_options, make_paths, pick_engines, pick_tools
from ._bench_view import render_bench
from ._engines import parse_engines
from ._render import GB, Stats, print_json, progress_bar, stdout_console
from ._runner import Ready, Sample, Step, WorkerSpec, lanes, plan_steps, run_workers
from ._system import mount_of
from .bench_data import add_bench_data_parser
from .bench_load import add_bench_load_parser
from .clean import remove_leftovers

__all__ = ["BenchOptions", "OpStats", "BenchResult", "run_bench", "parse_dir_map",
           "add_bench_parser"]


@dataclasses.dataclass(frozen=True)
class BenchOptions:
    """What to measure. ``gpus`` pairs with ``dirs`` (from ``--dir-map``); process i uses
    ``dirs[i % len(dirs)]``. As in ds_io, the handle gets ``single_submit`` and
    ``overlap_events = not sequential_requests`` on top of ``config``. ``engines`` are
    deepnvme's engines to sweep ("auto" allowed; empty: ``config.engine``). ``random_size``
    switches to random reads of that many bytes each (then ``write`` must be False)."""

    dirs: tuple[str, ...] = (".",)
    gpus: tuple[int, ...] = ()
    io_size: int = 1 << 30
    read: bool = True
    write: bool = True
    config: IOConfig = dataclasses.field(default_factory=resolve_config)
    single_submit: bool = False
    sequential_requests: bool = False
    procs: int = 1
    loops: int = 3
    warmup: int = 1
    validate: bool = False
    compare: bool = False
    gpu: bool = False
    gds: bool = False
    engines: tuple[str, ...] = ()
    random_size: int | None = None

    def effective_config(self) -> IOConfig:
        return self.config.replace(single_submit=self.single_submit,
                                   overlap_events=not self.sequential_requests)


@dataclasses.dataclass(frozen=True)
class OpStats:
    """All timings of one (tool, engine, op): ``task_seconds`` per process and loop,
    ``e2e_seconds`` per loop. ``engine`` is deepnvme's engine, "libaio" for fio, None for plain
    Python. Random reads (``op == "randread"``) also carry ``random_size`` and the mean
    seconds one read was in flight, per process and loop (``latency_seconds``)."""

    tool: str
    op: str
    io_size: int
    procs: int
    task_seconds: tuple[float, ...]
    e2e_seconds: tuple[float, ...]
    engine: str | None = None
    random_size: int = 0
    latency_seconds: tuple[float, ...] = ()

    @property
    def task_latency(self) -> Stats:
        return Stats.of(self.task_seconds)

    @property
    def e2e_latency(self) -> Stats:
        return Stats.of(self.e2e_seconds)

    @property
    def task_gbps(self) -> Stats:
        return Stats.of([self.io_size / s / GB for s in self.task_seconds])

    @property
    def e2e_gbps(self) -> Stats:
        return Stats.of([self.io_size * self.procs / s / GB for s in self.e2e_seconds])

    @property
    def reads(self) -> int:
        """Random reads per process and loop (0 for whole-file transfers)."""
        return self.io_size // self.random_size if self.random_size else 0

    @property
    def iops(self) -> Stats:
        """Random reads per second of all processes of a step."""
        return Stats.of([self.reads * self.procs / s for s in self.e2e_seconds])

    @property
    def mbps(self) -> Stats:
        """Random-read MB/s (1 MB = 1e6 bytes) of all processes of a step."""
        return Stats.of([self.io_size * self.procs / s / 1e6 for s in self.e2e_seconds])

    @property
    def read_latency(self) -> Stats:
        """Mean seconds one random read was in flight, over processes and loops."""
        return Stats.of(self.latency_seconds)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "tool": self.tool, "engine": self.engine, "op": self.op,
            "e2e_GBps": self.e2e_gbps.to_dict(), "e2e_latency_s": self.e2e_latency.to_dict(),
            "task_GBps": self.task_gbps.to_dict(), "task_latency_s": self.task_latency.to_dict(),
            "e2e_seconds": list(self.e2e_seconds), "task_seconds": list(self.task_seconds)}
        if self.random_size:
            out.update({"random_size": self.random_size, "reads": self.reads,
                        "IOPS": self.iops.to_dict(), "MBps": self.mbps.to_dict(),
                        "read_latency_s": self.read_latency.to_dict(),
                        "read_latency_seconds": list(self.latency_seconds)})
        return out


@dataclasses.dataclass(frozen=True)
class BenchResult:
    """Result of :func:`run_bench`; ``o_direct``/``pinned`` say how deepnvme actually ran;
    ``engines`` are deepnvme's engines in row order (the first is the reference of speedups)."""

    dirs: tuple[str, ...]
    filesystems: tuple[str, ...]
    io_size: int
    procs: int
    loops: int
    warmup: int
    config: IOConfig
    o_direct: bool
    pinned: bool
    gpu: bool
    tools: tuple[str, ...]
    ops: tuple[OpStats, ...]
    notes: tuple[str, ...]
    gds: bool = False
    engines: tuple[str, ...] = ()
    random_size: int | None = None
    validated: tuple[int, int] | None = None  # --validate: (writes, reads) checked, all procs

    def get(self, tool: str, op: str, engine: str | None = None) -> OpStats | None:
        """The row of ``tool`` and ``op`` (deepnvme: of ``engine``, default the first)."""
        return next((o for o in self.ops if o.tool == tool and o.op == op
                     and (engine is None or o.engine == engine)), None)

    @property
    def compared(self) -> bool:
        """Whether some op has several rows (tools or engines) to compare."""
        return len(self.ops) > len({o.op for o in self.ops})

    def ratio(self, row: OpStats, *, per_task: bool = False) -> float | None:
        """deepnvme's (first engine's) median e2e (or task) rate over ``row``'s; None for that
        row itself."""
        ours = self.get("deepnvme", row.op, self.engines[0] if self.engines else None)
        if ours is None or ours is row:
            return None
        if per_task:
            return ours.task_gbps.median / row.task_gbps.median
        return ours.e2e_gbps.median / row.e2e_gbps.median

    def speedup(self, tool: str, op: str) -> float | None:
        """deepnvme's median e2e GB/s divided by ``tool``'s, for ``op``."""
        theirs = self.get(tool, op)
        return None if theirs is None else self.ratio(theirs)

    def to_dict(self) -> dict[str, Any]:
        def vs(o: OpStats) -> str:
            return f"{o.op}_vs_" + (f"deepnvme-{o.engine}" if o.tool == "deepnvme" else o.tool)

        speedup = {vs(o): r for o in self.ops if (r := self.ratio(o)) is not None}
        return {"GB": "1e9 bytes", "dirs": list(self.dirs), "filesystems": list(self.filesystems),
                "io_size": self.io_size, "procs": self.procs, "loops": self.loops,
                "warmup_loops": self.warmup, "config": self.config.to_deepspeed()["aio"],
                "engines": list(self.engines), "random_size": self.random_size,
                "o_direct": self.o_direct, "pinned": self.pinned, "gpu": self.gpu,
                "handle": "GdsHandle" if self.gds else "AioHandle",
                "device": "cuda" if self.gpu or self.gds else "cpu",
                "tools": list(self.tools), "results": [o.to_dict() for o in self.ops],
                "speedup": speedup, "notes": list(self.notes),
                "validated": None if self.validated is None else
                dict(zip(("writes", "reads"), self.validated))}


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


def run_bench(options: BenchOptions, *, progress: Any = None) -> BenchResult:
    """Run the benchmark described by ``options``; blocking. ``progress`` is an optional rich
    ``Progress`` whose first task is advanced once per timed transfer (per process).
    Temporary files are removed before this returns or raises (Ctrl-C included)."""
    remove_leftovers(options.dirs)
    notes = check_options(options)
    tools = pick_tools(options, notes)
    engines = pick_engines(options, notes)
    steps = plan_steps(tools=tools, engines=engines, write=options.write, read=options.read,
                       loops=options.loops, warmup=options.warmup)
    if progress is not None:
        progress.update(progress.task_ids[0], total=len(steps) * options.procs)
    config = options.effective_config()
    paths = make_paths(options.dirs, options.procs)
    specs = [WorkerSpec(index=i, path=p, io_size=options.io_size, config=config,
                        steps=steps, validate=options.validate,
                        gpu=(options.gpus[i % len(options.gpus)] if options.gpus else 0)
                        if options.gpu or options.gds else None, gds=options.gds,
                        random_size=options.random_size)
             for i, p in enumerate(paths)]
    ready: list[Ready] = []
    samples: list[Sample] = []

    def on_event(event: object) -> None:
        if isinstance(event, Ready):
            ready.append(event)
        elif isinstance(event, Sample):
            samples.append(event)
            if progress is not None:
                progress.advance(progress.task_ids[0])

    run_workers(specs, on_event)
    o_direct = bool(ready) and all(r.o_direct for r in ready)
    pinned = bool(ready) and all(r.pinned for r in ready)
    notes += _run_notes(o_direct, pinned, options)
    fs = tuple((m.fstype if (m := mount_of(d)) else "unknown") for d in options.dirs)
    return BenchResult(tuple(os.path.abspath(d) for d in options.dirs), fs, options.io_size,
                       options.procs, options.loops, options.warmup, config, o_direct, pinned,
                       options.gpu or options.gds, tools,
                       _aggregate(steps, lanes(tools, engines), samples, options),
                       tuple(notes), gds=options.gds, engines=engines,
                       random_size=options.random_size, validated=_validated(steps, options))


def _validated(steps: tuple[Step, ...], o: BenchOptions) -> tuple[int, int] | None:
    """(writes, reads) that --validate compared with the pattern: every step but fio's, in
    every process (a mismatch raises, so reaching here means all matched)."""
    if not o.validate:
        return None
    checked = [s for s in steps if s.tool != "fio"]
    return (sum(s.write for s in checked) * o.procs, sum(not s.write for s in checked) * o.procs)


def _run_notes(o_direct: bool, pinned: bool, o: BenchOptions) -> list[str]:
    notes = []
    if not o_direct:
        notes.append("O_DIRECT was not available; deepnvme's reads were made cold by evicting "
                     "the file from the page cache")
    if not pinned:
        notes.append("buffers could not be page-locked (RLIMIT_MEMLOCK); numbers may be lower "
                     "than with locked memory (see 'deepnvme report')")
    if o.random_size:
        notes.append("latency = mean time one read is in flight: deepnvme's is reads in flight "
                     "(queue_depth per worker with io_uring/aio, in all with threads) / IOPS, "
                     "fio's is measured (lat_ns mean), with iodepth = queue_depth x parallelism")
    return notes


def _aggregate(steps: tuple[Step, ...], rows: list[tuple[str, str | None]],
               samples: list[Sample], o: BenchOptions) -> tuple[OpStats, ...]:
    """One :class:`OpStats` per op and (tool, engine) of ``rows``, writes first."""
    by_step: dict[int, list[Sample]] = {}
    for s in samples:
        by_step.setdefault(s.step, []).append(s)
    out: list[OpStats] = []
    for write in (True, False):
        for tool, engine in rows:
            idx = [i for i, s in enumerate(steps) if s.loop >= 0 and s.tool == tool
                   and s.engine == engine and s.write == write]
            if idx:
                out.append(_op_stats(tool, engine, write, [by_step.get(i, []) for i in idx], o))
    return tuple(out)


def _op_stats(tool: str, engine: str | None, write: bool, groups: list[list[Sample]],
              o: BenchOptions) -> OpStats:
    """One row from the samples of each timed step of a (tool, engine, op)."""
    op = "write" if write else "randread" if o.random_size else "read"
    task = tuple(x.timing.seconds for g in groups for x in g)
    if any(len(g) != o.procs for g in groups):
        raise DeepNVMeError(f"missing timings for {tool} {op}: got {len(task)} of "
                            f"{len(groups) * o.procs}")
    latency = tuple(x.timing.latency for g in groups for x in g if x.timing.latency is not None)
    return OpStats(tool, op, o.io_size, o.procs, task, tuple(_e2e(tool, g) for g in groups),
                   engine=engine if tool == "deepnvme" else "libaio" if tool == "fio" else None,
                   random_size=o.random_size or 0, latency_seconds=latency)


def _e2e(tool: str, group: list[Sample]) -> float:
    if tool == "fio":  # fio reports its own runtime, without process start-up
        return max(s.timing.seconds for s in group)
    return max(s.timing.end for s in group) - min(s.timing.start for s in group)


# --- command line ------------------------------------------------------------------------

def add_bench_parser(subparsers: Any) -> None:
    """Register ``deepnvme bench`` (flags mirror DeepSpeed's ds_io)."""
    b = subparsers.add_parser(
        "bench", help="measure write (to stable storage) and cold read GB/s, like ds_io",
        description=__doc__.split("\n\n")[0].replace("``", ""))
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
