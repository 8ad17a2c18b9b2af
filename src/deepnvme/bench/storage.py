"""``deepnvme bench``: how fast is my storage path? (DeepSpeed's ds_io, with honest numbers).

Writes go to a new file and are timed until ``fsync`` returns (stable storage); reads are cold
(O_DIRECT, and the file's pages are dropped from the page cache before every read). Each
process moves ``io_size`` bytes per step; ``--procs N`` runs N barrier-synchronised processes.
Latencies are seconds per transfer; rates are GB/s with 1 GB = 1e9 bytes. *Task* figures are
per process, *end-to-end* (e2e) figures cover all processes of a step, from the first start
to the last finish (the same as task with one process). ``--compare`` times plain Python
file I/O and fio on the same files in the same loops (see :mod:`deepnvme.bench._measure`).
``--engine a,b`` runs deepnvme once per I/O engine in the same loops, one row each.

``--random`` measures random reads instead: every ``--random-size`` block of an ``--io-size``
file once per loop, in random order, ``--queue-depth`` reads in flight per worker thread
(:meth:`~deepnvme.AioHandle.read_many`), cold (O_DIRECT, pages dropped before each loop);
IOPS, MB/s (1 MB = 1e6 bytes) and the mean latency of one read. ``--compare`` runs fio
``--rw=randread`` next to it.
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import DeepNVMeError
from ._files import remove_leftovers
from ._runner import Ready, Sample, Step, WorkerSpec, lanes, plan_steps, run_workers
from ._setup import check_options, make_paths, pick_engines, pick_tools
from ._storage_types import BenchOptions, BenchResult, OpStats
from ._system import mount_of

__all__ = ["BenchOptions", "OpStats", "BenchResult", "run_bench"]


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

