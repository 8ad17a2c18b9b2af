"""``deepnvme bench load PATH``: which checkpoint reader is fastest on this checkpoint, here?

Times deepnvme's loader against the stock readers that are installed (safetensors'
``load_file`` and ``safe_open``, ``torch.load`` with and without ``mmap``) on a
``.safetensors`` file, a ``torch.save`` file or a Hugging Face model directory. Repetitions
are interleaved (each repetition runs every reader once); every read is made cold first and
marked ``cold`` or ``warm`` by what ``mincore`` then finds in the page cache; each result is
materialised inside the timing (see :mod:`deepnvme.bench._load_readers`). GB = 1e9 bytes of
the checkpoint's files.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from ..errors import DeepNVMeError, UsageError
from ._load_readers import READERS, Reader, read_checkpoint, read_errors, touch
from ._load_source import Checkpoint, find_checkpoint
from ._reading import EVICTIONS, check_cold, evict, missing_module, overall_cache, pick_eviction
from ._units import GB, Stats

__all__ = ["LoadOptions", "LoadRun", "ReaderRow", "LoadBenchResult", "run_load_bench"]


@dataclasses.dataclass(frozen=True)
class LoadOptions:
    """What to time: ``readers`` (names of :data:`READERS`; empty: every one that reads the
    format), ``reps`` interleaved repetitions, results on ``device`` (``cpu`` or ``cuda``),
    ``evict``: how files are made cold (``auto``, ``drop-caches``, ``fadvise``, ``none``)."""

    path: str
    readers: tuple[str, ...] = ()
    reps: int = 3
    device: str = "cpu"
    evict: str = "auto"


@dataclasses.dataclass(frozen=True)
class LoadRun:
    """One timed read: seconds (read + materialise), ``cache`` (``cold``/``warm``) and the
    bytes found in the page cache just before it (None: could not be measured)."""

    seconds: float
    cache: str
    resident_bytes: int | None


@dataclasses.dataclass(frozen=True)
class ReaderRow:
    """Every run of one reader; ``call`` is how it was called, ``tensors`` how many it loaded."""

    reader: str
    call: str
    tensors: int
    runs: tuple[LoadRun, ...]

    @property
    def seconds(self) -> Stats:
        return Stats.of([r.seconds for r in self.runs])

    def gbps(self, nbytes: int) -> Stats:
        return Stats.of([nbytes / r.seconds / GB for r in self.runs])

    @property
    def cache(self) -> str:
        """``cold`` or ``warm`` when every run was, else ``mixed``."""
        return overall_cache(r.cache for r in self.runs)


@dataclasses.dataclass(frozen=True)
class LoadBenchResult:
    """Result of :func:`run_load_bench`: rows in reader order, ``eviction`` as it was done."""

    checkpoint: Checkpoint
    device: str
    reps: int
    eviction: str
    rows: tuple[ReaderRow, ...]
    notes: tuple[str, ...]

    @property
    def ranked(self) -> list[ReaderRow]:
        """Rows by median seconds, fastest first."""
        return sorted(self.rows, key=lambda r: r.seconds.median)

    def ratio(self, row: ReaderRow) -> float:
        """``row``'s median seconds over the fastest's (1.00 for the fastest)."""
        return row.seconds.median / self.ranked[0].seconds.median

    @property
    def margin(self) -> float | None:
        """The runner-up's median seconds over the fastest's; None with a single reader."""
        ranked = self.ranked
        return ranked[1].seconds.median / ranked[0].seconds.median if len(ranked) > 1 else None

    def headline(self) -> str:
        """``fastest here: X (N.NNx the next)``."""
        margin = self.margin
        more = "the only reader" if margin is None else f"{margin:.2f}x the next"
        return f"fastest here: {self.ranked[0].reader} ({more})"

    def to_dict(self) -> dict[str, Any]:
        c = self.checkpoint
        n = c.nbytes
        return {"GB": "1e9 bytes", "path": c.path, "format": c.format, "files": list(c.files),
                "bytes": n, "device": self.device, "reps": self.reps, "eviction": self.eviction,
                "readers": [{"reader": r.reader, "call": r.call, "cache": r.cache,
                             "tensors": r.tensors, "seconds": r.seconds.to_dict(),
                             "GBps": r.gbps(n).to_dict(), "ratio_to_fastest": self.ratio(r),
                             "runs": [dataclasses.asdict(x) for x in r.runs]} for r in self.rows],
                "fastest": self.ranked[0].reader, "fastest_vs_next": self.margin,
                "notes": list(self.notes)}


def _pick_readers(names: tuple[str, ...], ckpt: Checkpoint, notes: list[str]) -> list[Reader]:
    """The readers to time; those not installed or not for this format get a note."""
    unknown = [n for n in names if n not in READERS]
    if unknown:
        raise UsageError(f"unknown reader(s) {', '.join(unknown)}; choose from {', '.join(READERS)}")
    chosen = []
    for name in names or tuple(READERS):
        reader = READERS[name]
        if ckpt.format not in reader.formats:
            if names:
                notes.append(f"{name} skipped: it does not read {ckpt.format} files")
        elif (why := missing_module(reader)) is not None:
            notes.append(f"{name} skipped: {why}")
        else:
            chosen.append(reader)
    return chosen


def _timed(reader: Reader, ckpt: Checkpoint, device: str, cache: tuple[int | None, str]
           ) -> tuple[LoadRun, str, int]:
    """One read of ``ckpt`` by ``reader``, materialised: (run, how it was called, tensors)."""
    start = time.perf_counter()
    objs, call = read_checkpoint(reader, ckpt)
    tensors = touch(objs, device)
    seconds = time.perf_counter() - start
    del objs
    return LoadRun(seconds=seconds, cache=cache[1], resident_bytes=cache[0]), call, tensors


def run_load_bench(options: LoadOptions, *, progress: Any = None) -> LoadBenchResult:
    """Time each reader ``options.reps`` times, interleaved; blocking. ``progress`` is an
    optional rich ``Progress`` whose first task advances once per timed read."""
    if options.device not in ("cpu", "cuda"):
        raise UsageError(f"--device must be cpu or cuda, got {options.device!r}")
    if options.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here (use --device cpu)")
    if options.evict not in EVICTIONS:
        raise UsageError(f"--evict must be one of {', '.join(EVICTIONS)}, got {options.evict!r}")
    ckpt = find_checkpoint(options.path)
    notes: list[str] = []
    readers = _pick_readers(options.readers, ckpt, notes)
    if not readers:
        raise UsageError(f"no reader to time for {ckpt.format} files: {'; '.join(notes)}")
    how = pick_eviction(options.evict)
    if progress is not None:
        progress.update(progress.task_ids[0], total=options.reps * len(readers))
    runs: dict[str, list[LoadRun]] = {r.name: [] for r in readers}
    calls: dict[str, tuple[str, int]] = {}
    errors = read_errors()
    for _ in range(options.reps):
        for reader in [r for r in readers if r.name in runs]:
            how = evict(ckpt.files, how)
            try:
                run, call, tensors = _timed(reader, ckpt, options.device, check_cold(ckpt.files))
            except errors as exc:
                notes.append(f"{reader.name} failed and was dropped: {' '.join(str(exc).split())}")
                del runs[reader.name]
                continue
            runs[reader.name].append(run)
            calls[reader.name] = (call, tensors)
            if progress is not None:
                progress.advance(progress.task_ids[0])
    if not runs:
        raise DeepNVMeError(f"no reader could load {options.path!r}: {'; '.join(notes)}")
    rows = tuple(ReaderRow(reader=name, call=calls[name][0], tensors=calls[name][1], runs=tuple(r))
                 for name, r in runs.items())
    if any(row.cache != "cold" for row in rows) and how != "none":
        notes.append("some reads were warm: the page cache kept the files after eviction "
                     "(e.g. tmpfs, or pages mapped by another process); their GB/s is the cache's")
    return LoadBenchResult(checkpoint=ckpt, device=options.device, reps=options.reps,
                           eviction=how, rows=rows, notes=tuple(notes))
