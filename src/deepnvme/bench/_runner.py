"""Run the timed steps of ``deepnvme bench`` in one process, or in N barrier-synchronised ones.

Each process owns one file and one buffer of ``io_size`` bytes, and one handle per deepnvme
engine of the sweep (built once, before the timed steps). Before every timed step all
processes meet at a barrier, so with ``--procs N`` the N transfers of a step run at the same
time (ds_io's multi-process mode). Processes are started with ``spawn`` (no forked torch or
thread state). Temporary files are removed by the workers and again by the parent, whatever
happens (errors, Ctrl-C).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing as mp
import os
import queue as queue_mod
import signal
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..config import IOConfig
from ..errors import DeepNVMeError, ValidationError
from ..memory.pinned import free_cpu_locked_tensor, is_pinned, new_cpu_locked_tensor
from ._measure import Measurer, RandomReads, Timing, check_file, fill_pattern, probe_direct, remove

__all__ = ["Step", "WorkerSpec", "Sample", "Ready", "lanes", "plan_steps", "run_workers"]

log = logging.getLogger(__name__)

_BARRIER_TIMEOUT_S = 900.0
_PR_SET_PDEATHSIG = 1


@dataclasses.dataclass(frozen=True)
class Step:
    """One timed transfer: ``loop`` < 0 for warm-up loops; ``engine`` for deepnvme's steps."""

    loop: int
    write: bool
    tool: str
    engine: str | None = None


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything one process needs (picklable)."""

    index: int
    path: str
    io_size: int
    config: IOConfig
    steps: tuple[Step, ...]
    validate: bool = False
    gpu: int | None = None
    gds: bool = False
    random_size: int | None = None  # reads are random reads of this many bytes each

    @property
    def engines(self) -> tuple[str, ...]:
        """deepnvme's engines in the steps, first use first."""
        return tuple(dict.fromkeys(s.engine for s in self.steps if s.engine is not None))


@dataclasses.dataclass(frozen=True)
class Ready:
    """Sent once per process after set-up: whether O_DIRECT applies and the buffer is locked."""

    index: int
    o_direct: bool
    pinned: bool


@dataclasses.dataclass(frozen=True)
class Sample:
    index: int
    step: int
    timing: Timing


def lanes(tools: tuple[str, ...], engines: tuple[str, ...]) -> list[tuple[str, str | None]]:
    """(tool, engine) in row order: deepnvme once per engine where ``tools`` name it."""
    return [(t, e) for t in tools for e in (engines if t == "deepnvme" else (None,))]


def plan_steps(*, tools: tuple[str, ...], engines: tuple[str, ...], write: bool, read: bool,
               loops: int, warmup: int) -> tuple[Step, ...]:
    """Steps in run order: per loop all writes, then all reads; the tools interleave per loop,
    deepnvme once per engine (in ``engines`` order, where the tools name deepnvme).

    Writes run deepnvme last, so the file holds the pattern that reads are validated against.
    """
    order = lanes(tools, engines)
    steps: list[Step] = []
    for loop in range(-warmup, loops):
        if write:
            steps += [Step(loop, True, t, e) for t, e in reversed(order)]
        if read:
            steps += [Step(loop, False, t, e) for t, e in order]
    return tuple(steps)


def _wait(barrier: Any) -> None:
    if barrier is not None:
        barrier.wait()


def run_worker(spec: WorkerSpec, emit: Callable[[object], None], barrier: Any = None) -> None:
    """Set up, run every step (meeting ``barrier`` before each), clean up. Blocking."""
    with warnings.catch_warnings():  # RLIMIT_MEMLOCK is reported through Ready.pinned
        warnings.simplefilter("ignore", RuntimeWarning)
        buf = new_cpu_locked_tensor(spec.io_size, torch.uint8)
    measurers: dict[str | None, Measurer] = {}
    try:
        fill_pattern(buf, seed=spec.index)
        expected = buf.clone() if spec.validate else None
        device_buf = buf.to(f"cuda:{spec.gpu}") if spec.gpu is not None else None
        reads = (RandomReads(buf, spec.random_size, seed=spec.index)
                 if spec.random_size is not None else None)
        for engine in spec.engines or (spec.config.engine,):
            measurers[engine] = Measurer(
                path=spec.path, buf=buf, config=spec.config.replace(engine=engine),
                device_buf=device_buf, gds=spec.gds, random=reads, scrub=spec.validate)
        first = next(iter(measurers.values()))
        measurers[None] = first  # python and fio steps: any measurer's file and buffer
        if not any(s.write for s in spec.steps):  # read-only run: lay the file out, untimed
            remove(spec.path)
            first.handle.submit_write(buf, spec.path, fsync=True).result()
        else:
            with open(spec.path, "wb"):
                pass
        emit(Ready(spec.index, spec.config.o_direct and probe_direct(spec.path), is_pinned(buf)))
        for i, step in enumerate(spec.steps):
            _wait(barrier)
            timing = measurers[step.engine].measure(step.tool, write=step.write)
            if expected is not None and step.tool != "fio":
                _validate(step, spec.path, buf, device_buf, expected)
            emit(Sample(spec.index, i, timing))
    finally:
        for m in set(measurers.values()):
            m.close()
        remove(spec.path)
        free_cpu_locked_tensor(buf)


def _validate(step: Step, path: str, buf: torch.Tensor, device_buf: torch.Tensor | None,
              expected: torch.Tensor) -> None:
    if step.write:
        check_file(path, expected)
        return
    got = device_buf.cpu() if device_buf is not None else buf
    if not torch.equal(got, expected):
        bad = int(torch.nonzero(got != expected)[0])
        raise ValidationError(f"validation failed: {step.tool} read wrong bytes", path=path,
                              offset=bad, size=expected.numel())


def _die_with_parent() -> None:
    """Have the kernel SIGKILL this worker when the bench process dies (Linux), so a killed
    bench leaves no orphan writing into files that ``deepnvme clean`` judges abandoned."""
    parent = mp.parent_process()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            log.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    except (OSError, AttributeError) as exc:  # not Linux: workers stop at the barrier timeout
        log.debug("no parent-death signal for bench workers: %s", exc)
    if parent is not None and os.getppid() != parent.pid:  # the parent died before prctl
        os._exit(1)


def _child(spec: WorkerSpec, q: Any, barrier: Any) -> None:
    _die_with_parent()
    try:
        run_worker(spec, q.put, barrier)
        q.put(("done", spec.index))
    except KeyboardInterrupt:
        barrier.abort()
    except BaseException as exc:  # reported to the parent, which raises it
        q.put(("error", spec.index, f"{type(exc).__name__}: {exc}"))
        barrier.abort()


def run_workers(specs: list[WorkerSpec], on_event: Callable[[object], None]) -> None:
    """Run the specs (in-process for one, in spawned processes for several); ``on_event``
    receives every :class:`Ready` and :class:`Sample` in the parent. Blocking; raises the
    first worker's error. Every spec's file is removed before this returns or raises."""
    try:
        if len(specs) == 1:
            run_worker(specs[0], on_event)
        else:
            _run_processes(specs, on_event)
    finally:
        for spec in specs:
            remove(spec.path)


def _run_processes(specs: list[WorkerSpec], on_event: Callable[[object], None]) -> None:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    barrier = ctx.Barrier(len(specs), timeout=_BARRIER_TIMEOUT_S)
    procs = [ctx.Process(target=_child, args=(s, q, barrier), name=f"deepnvme-bench-{s.index}",
                         daemon=True) for s in specs]
    try:
        for p in procs:
            p.start()
        done: set[int] = set()
        while len(done) < len(procs):
            try:
                msg = q.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and len(done) < len(procs):
                    raise DeepNVMeError(f"benchmark process {dead[0].name} died with exit code "
                                        f"{dead[0].exitcode}") from None
                continue
            if isinstance(msg, tuple) and msg[0] == "done":
                done.add(msg[1])
            elif isinstance(msg, tuple) and msg[0] == "error":
                raise DeepNVMeError(f"benchmark process {msg[1]} failed: {msg[2]}")
            else:
                on_event(msg)
    finally:
        _stop(procs, barrier)
        q.close()


def _stop(procs: list[Any], barrier: Any) -> None:
    if any(p.is_alive() for p in procs):
        threading.Thread(target=barrier.abort, daemon=True).start()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
