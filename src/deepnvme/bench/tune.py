"""``deepnvme tune``: which handle settings are best on this storage? (DeepSpeed's ds_nvme_tune).

Each trial writes ``io_size`` bytes to a new file (timed until fsync returns) and reads them
back cold, ``loops`` times, with an :class:`~deepnvme.AioHandle` built from the trial's
settings; its score is the median GB/s (1 GB = 1e9 bytes). The sweep is pruned: coordinate
search from DeepSpeed's defaults and the engine ``auto`` picks, one dimension at a time (the
engine first, among those this system runs), stopping a dimension once the next value no
longer helps by 3 %, within ``--budget`` seconds. ``single_submit`` is swept only when a
``--space`` file lists both values (otherwise it is written as false, batched submission);
``overlap_events`` changes nothing in any engine and is written as false. The winner is
written as a DeepSpeed ``{"aio": {...}}`` JSON, its ``engine`` included, that
``AioHandle.from_config`` and DeepSpeed read.
"""

from __future__ import annotations

import dataclasses
import json
import operator
import os
import statistics
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..config import IOConfig, resolve_config
from ..errors import ConfigError, DeepNVMeError
from ..io.durable import create_temp, write_json
from ..memory.pinned import free_cpu_locked_tensor, new_cpu_locked_tensor
from ._engines import EngineStatus, auto_per_transfer, describe_choices, engine_statuses
from ._files import check_writable, remove_leftovers
from ._measure import Measurer, fill_pattern, remove
from ._search import Point, coordinate_search, grid
from ._tune_space import DIMENSIONS, TuneSpace, complete, default_space, load_space, runnable, start_point
from ._units import GB

__all__ = ["OBJECTIVES", "TuneSpace", "Trial", "TuneResult", "TuneInterrupted", "default_space",
           "load_space", "run_tune"]

OBJECTIVES = ("combined", "write", "read")


@dataclasses.dataclass(frozen=True)
class Trial:
    """One measured configuration: median GB/s of writes and cold reads."""

    block_size: int
    queue_depth: int
    intra_op_parallelism: int
    write_gbps: float
    read_gbps: float
    seconds: float
    engine: str
    single_submit: bool = False

    @property
    def combined_gbps(self) -> float:
        """Bytes moved by a write plus a read over the time of both (harmonic mean of rates)."""
        return 2 / (1 / self.write_gbps + 1 / self.read_gbps)

    def score(self, objective: str) -> float:
        return {"combined": self.combined_gbps, "write": self.write_gbps,
                "read": self.read_gbps}[objective]

    def config(self) -> IOConfig:
        return resolve_config({"engine": self.engine, "block_size": self.block_size,
                               "queue_depth": self.queue_depth,
                               "intra_op_parallelism": self.intra_op_parallelism,
                               "single_submit": self.single_submit, "overlap_events": False})

    def to_dict(self) -> dict[str, Any]:
        return {"engine": self.engine, "single_submit": self.single_submit,
                "block_size": self.block_size, "queue_depth": self.queue_depth,
                "intra_op_parallelism": self.intra_op_parallelism,
                "write_GBps": self.write_gbps, "read_GBps": self.read_gbps,
                "combined_GBps": self.combined_gbps, "seconds": self.seconds}


@dataclasses.dataclass(frozen=True)
class TuneResult:
    directory: str
    io_size: int
    loops: int
    space_size: int
    trials: tuple[Trial, ...]
    best: Mapping[str, Trial]  # objective -> trial
    objective: str
    output: str | None
    elapsed: float
    budget: float
    budget_exhausted: bool
    notes: tuple[str, ...]
    interrupted: bool = False  # Ctrl-C ended the sweep: the winners are the best so far

    def deepspeed_config(self) -> dict[str, dict[str, Any]]:
        """The DeepSpeed ``{"aio": {...}}`` section of the winner for :attr:`objective`."""
        return self.best[self.objective].config().to_deepspeed()

    def to_dict(self) -> dict[str, Any]:
        return {"GB": "1e9 bytes", "directory": self.directory, "io_size": self.io_size,
                "loops": self.loops, "space_size": self.space_size,
                "trials": [t.to_dict() for t in self.trials],
                "best": {k: v.to_dict() for k, v in self.best.items()},
                "objective": self.objective, "config": self.deepspeed_config(),
                "output": self.output, "elapsed_s": self.elapsed, "budget_s": self.budget,
                "budget_exhausted": self.budget_exhausted, "interrupted": self.interrupted,
                "notes": list(self.notes)}


class TuneInterrupted(KeyboardInterrupt):
    """Ctrl-C during the sweep, after at least one trial: ``result`` holds the best
    configuration found so far (already written to its ``output``)."""

    def __init__(self, result: TuneResult) -> None:
        super().__init__("tune interrupted")
        self.result = result


class _Trials:
    """Measures configurations once each (cached), within a time budget."""

    def __init__(self, path: str, buf: torch.Tensor, loops: int, budget: float,
                 on_trial: Callable[[Trial, float], None] | None) -> None:
        self.path, self.buf, self.loops, self.budget = path, buf, loops, budget
        self.on_trial = on_trial
        self.cache: dict[Point, Trial] = {}
        self.started = time.perf_counter()
        self.last = 0.0
        self.exhausted = False

    def get(self, point: Point) -> Trial | None:
        if point in self.cache:
            return self.cache[point]
        elapsed = time.perf_counter() - self.started
        if self.cache and elapsed + self.last > self.budget:
            self.exhausted = True
            return None
        values = dict(point)
        cfg = resolve_config(values)
        t0 = time.perf_counter()
        measurer = Measurer(path=self.path, buf=self.buf, config=cfg)
        writes, reads = [], []
        try:
            for _ in range(self.loops):
                writes.append(measurer.measure("deepnvme", write=True).seconds)
                reads.append(measurer.measure("deepnvme", write=False).seconds)
        finally:
            measurer.close()
        n = self.buf.numel()
        self.last = time.perf_counter() - t0
        trial = Trial(block_size=int(values["block_size"]), queue_depth=int(values["queue_depth"]),
                      intra_op_parallelism=int(values["intra_op_parallelism"]),
                      write_gbps=n / statistics.median(writes) / GB,
                      read_gbps=n / statistics.median(reads) / GB, seconds=self.last,
                      engine=str(values["engine"]), single_submit=bool(values["single_submit"]))
        self.cache[point] = trial
        if self.on_trial is not None:
            self.on_trial(trial, self.last)
        return trial


def run_tune(directory: str = ".", *, space: TuneSpace | None = None, io_size: int = 256 << 20,
             loops: int = 2, budget: float = 120.0, objective: str = "combined",
             exhaustive: bool = False, output: str | None = None,
             on_trial: Callable[[Trial, float], None] | None = None) -> TuneResult:
    """Sweep ``space`` in ``directory`` and return the trials and winners; blocking.

    Settings ``space`` leaves out take the default candidates; engines this system cannot
    run are dropped (with a note), and ``space_size`` counts what remains. Writes the winner
    for ``objective`` to ``output`` (durably) when given. The temporary file is removed
    before this returns or raises. Ctrl-C after the first trial writes the best so far and
    raises :class:`TuneInterrupted` carrying that result.
    """
    if objective not in OBJECTIVES:
        raise ConfigError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if io_size < 1 or loops < 1 or budget <= 0:
        raise ConfigError("--io-size and --loops must be >= 1 and --budget > 0")
    if not os.path.isdir(directory):
        raise DeepNVMeError(f"directory {directory!r} does not exist; pass one with --dir")
    if output is not None:
        check_writable(output, "--output")  # before the sweep, not after it
    remove_leftovers([directory])
    statuses = engine_statuses()
    space = runnable(complete(space) if space else default_space(), statuses)
    with warnings.catch_warnings():  # allocate first: a failure here leaves no temp file
        warnings.simplefilter("ignore", RuntimeWarning)
        buf = new_cpu_locked_tensor(io_size)
    try:
        path = create_temp(directory, "deepnvme-tune")
    except OSError as exc:
        free_cpu_locked_tensor(buf)
        raise DeepNVMeError(f"cannot create a file in {directory!r} ({exc.strerror}); pass a "
                            "writable directory with --dir") from None
    interrupted = False
    try:
        fill_pattern(buf, seed=0)
        _warm_up(path, buf)
        trials = _Trials(path, buf, loops, budget, on_trial)
        try:
            _sweep(space, trials, exhaustive, auto=next(e.name for e in statuses if e.auto))
        except KeyboardInterrupt:
            if not trials.cache:
                raise
            interrupted = True
    finally:
        remove(path)
        free_cpu_locked_tensor(buf)
    result = _result(directory, space, trials, objective, output, interrupted,
                     _auto_note(statuses))
    if output is not None:
        _write_config(result, output)
    if interrupted:
        raise TuneInterrupted(result)
    return result


def _auto_note(statuses: tuple[EngineStatus, ...]) -> str | None:
    """What ``engine="auto"`` does per transfer here, for the notes (None: one engine)."""
    choices = auto_per_transfer(statuses)
    if not choices:
        return None
    return ("each trial runs one engine for all its transfers; engine auto instead picks per "
            "transfer: " + describe_choices(choices))


def _result(directory: str, space: TuneSpace, trials: _Trials, objective: str,
            output: str | None, interrupted: bool, auto_note: str | None = None) -> TuneResult:
    """The winners among the trials measured, with notes on why the sweep stopped (and
    ``auto_note``)."""
    done = tuple(trials.cache.values())
    if not done:
        raise DeepNVMeError("no configuration could be measured")
    best = {obj: max(done, key=operator.methodcaller("score", obj)) for obj in OBJECTIVES}
    notes = list(space.notes)
    if trials.exhausted:
        notes.append(f"the {trials.budget:g} s budget ran out after {len(done)} configurations; "
                     "raise --budget to search further")
    if auto_note is not None:
        notes.append(auto_note)
    if interrupted:
        notes.append(f"interrupted (Ctrl-C) after {len(done)} configurations: the winners are "
                     "the best found so far")
    return TuneResult(os.path.abspath(directory), trials.buf.numel(), trials.loops, space.size,
                      done, best, objective, output, time.perf_counter() - trials.started,
                      trials.budget, trials.exhausted, tuple(notes), interrupted)


def _write_config(result: TuneResult, output: str) -> None:
    """Write the winner's DeepSpeed config durably and check that it reads back as chosen."""
    best = result.best[result.objective]
    write_json(output, result.deepspeed_config(), indent=2)
    with open(output) as f:  # the file must round-trip through the runtime's reader
        if IOConfig.from_deepspeed(json.load(f)) != best.config():
            raise DeepNVMeError(f"{output} does not read back as the chosen settings")


def _warm_up(path: str, buf: torch.Tensor) -> None:
    """One untimed write and read, so the first trial does not pay for first-use costs."""
    measurer = Measurer(path=path, buf=buf, config=resolve_config())
    try:
        measurer.measure("deepnvme", write=True)
        measurer.measure("deepnvme", write=False)
    finally:
        measurer.close()


def _sweep(space: TuneSpace, trials: _Trials, exhaustive: bool, *, auto: str) -> None:
    dims = {n: space.dims[n] for n in DIMENSIONS}
    if exhaustive:
        for point in grid(dims):
            if trials.get(point) is None:
                return
        return
    start = start_point(dims, auto)
    for objective in OBJECTIVES:  # measurements are shared; later searches reuse them
        def score(point: Point, o: str = objective) -> float | None:
            trial = trials.get(point)
            return None if trial is None else trial.score(o)
        if coordinate_search(dims, start, score) is None or trials.exhausted:
            return
