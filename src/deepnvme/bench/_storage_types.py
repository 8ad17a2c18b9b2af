"""What ``deepnvme bench`` measures and what it returns: :class:`BenchOptions`, one
:class:`OpStats` row per (tool, engine, op), and the whole :class:`BenchResult`."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config import IOConfig, resolve_config
from ._units import GB, Stats

__all__ = ["BenchOptions", "OpStats", "BenchResult"]


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
