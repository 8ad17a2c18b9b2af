"""``deepnvme bench data PREFIX``: samples/s of a token dataset, deepnvme against mmap readers.

Reads the same samples (windows of ``seq_len + 1`` tokens, batches of ``batch_size``) of the
Megatron indexed dataset ``PREFIX.bin``/``PREFIX.idx`` in a shuffled and a sequential order
with deepnvme's :meth:`~deepnvme.data.TokenDataset.batches`, a plain ``np.memmap`` and, where
installed, megatron-core's ``IndexedDataset``. Repetitions are interleaved; each timed read
is made cold first (page cache dropped as root, else the files fadvised) and marked ``cold`` or
``warm`` by what ``mincore`` then finds cached. GB = 1e9 bytes of sample tokens.
"""

from __future__ import annotations

import dataclasses
import resource
import time
from typing import Any

import torch

from ..data import TokenDataset
from ..errors import UsageError
from ._data_readers import DATA_READERS, DataReader, plain_files, sample_orders
from ._reading import EVICTIONS, check_cold, evict, missing_module, overall_cache, pick_eviction
from ._units import GB, Stats

__all__ = ["DataOptions", "DataRun", "DataRow", "DataBenchResult", "run_data_bench", "cpu_seconds"]


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """What to time: ``shuffled`` random samples and ``sequential`` consecutive ones of
    ``seq_len + 1`` tokens in batches of ``batch_size``, ``reps`` interleaved repetitions;
    ``readers`` (names of the readers; empty: every installed one), ``prefetch`` batches in
    flight for deepnvme, ``evict`` as ``deepnvme bench load``'s, ``seed`` for the orders,
    ``torch_threads``: torch's intra-op threads while timing (1, as in DataLoader workers: on
    a busy machine two-thread copies of one batch wait on each other)."""

    prefix: str
    seq_len: int = 2048
    batch_size: int = 32
    shuffled: int = 4096
    sequential: int = 16384
    reps: int = 3
    readers: tuple[str, ...] = ()
    prefetch: int = 16
    evict: str = "auto"
    seed: int = 0
    torch_threads: int = 1


@dataclasses.dataclass(frozen=True)
class DataRun:
    """One timed pass over an order: seconds, ``cache`` (cold/warm), the token checksum and
    ``cpu_seconds``: user + system CPU of this process and its finished children (getrusage)."""

    seconds: float
    cache: str
    checksum: int
    cpu_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class DataRow:
    """Every run of one reader over one order of ``samples`` samples of ``sample_bytes``."""

    order: str
    reader: str
    call: str
    samples: int
    sample_bytes: int
    runs: tuple[DataRun, ...]

    @property
    def samples_per_s(self) -> Stats:
        return Stats.of([self.samples / r.seconds for r in self.runs])

    @property
    def gbps(self) -> Stats:
        return Stats.of([self.samples * self.sample_bytes / r.seconds / GB for r in self.runs])

    @property
    def cpu_us_per_sample(self) -> Stats:
        """CPU microseconds per sample (all threads, both user and system time)."""
        return Stats.of([r.cpu_seconds / self.samples * 1e6 for r in self.runs])

    @property
    def cache(self) -> str:
        """``cold`` or ``warm`` when every run was, else ``mixed``."""
        return overall_cache(r.cache for r in self.runs)


@dataclasses.dataclass(frozen=True)
class DataBenchResult:
    """Result of :func:`run_data_bench`: rows by order then reader; ``eviction`` as done."""

    options: DataOptions
    dataset: str
    eviction: str
    rows: tuple[DataRow, ...]
    notes: tuple[str, ...]

    def ratio(self, row: DataRow, peer: str) -> float | None:
        """``row``'s median samples/s over ``peer``'s on the same order (None: no such row)."""
        for other in self.rows:
            if other.order == row.order and other.reader == peer:
                return row.samples_per_s.median / other.samples_per_s.median
        return None

    def to_dict(self) -> dict[str, Any]:
        peers = [r for r in DATA_READERS if r != "deepnvme"]
        return {"GB": "1e9 bytes of sample tokens", "dataset": self.dataset,
                "options": dataclasses.asdict(self.options), "eviction": self.eviction,
                "rows": [{"order": r.order, "reader": r.reader, "call": r.call, "cache": r.cache,
                          "samples": r.samples, "sample_bytes": r.sample_bytes,
                          "samples_per_s": r.samples_per_s.to_dict(), "GBps": r.gbps.to_dict(),
                          "cpu_us_per_sample": r.cpu_us_per_sample.to_dict(),
                          "runs": [dataclasses.asdict(x) for x in r.runs],
                          **({f"deepnvme_vs_{p}": self.ratio(r, p) for p in peers}
                             if r.reader == "deepnvme" else {})}
                         for r in self.rows],
                "notes": list(self.notes)}


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (every thread) and its waited-for children."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _pick(names: tuple[str, ...], notes: list[str]) -> list[DataReader]:
    unknown = [n for n in names if n not in DATA_READERS]
    if unknown:
        raise UsageError(f"unknown reader(s) {', '.join(unknown)}; choose from {', '.join(DATA_READERS)}")
    chosen = []
    for name in names or tuple(DATA_READERS):
        why = missing_module(DATA_READERS[name])
        if why is None:
            chosen.append(DATA_READERS[name])
        else:
            notes.append(f"{name} skipped: {why}")
    return chosen


def run_data_bench(options: DataOptions, *, progress: Any = None) -> DataBenchResult:
    """Time every reader on both orders ``options.reps`` times, interleaved; blocking.
    ``progress``: an optional rich ``Progress`` whose first task advances once per timed pass."""
    if options.evict not in EVICTIONS:
        raise UsageError(f"--evict must be one of {', '.join(EVICTIONS)}, got {options.evict!r}")
    notes: list[str] = []
    readers = _pick(options.readers, notes)
    if not readers:
        raise UsageError(f"no reader to time: {'; '.join(notes)}")
    threads = torch.get_num_threads()
    torch.set_num_threads(options.torch_threads)
    try:
        return _run(options, readers, notes, progress)
    finally:
        torch.set_num_threads(threads)


def _run(options: DataOptions, readers: list[DataReader], notes: list[str], progress: Any) -> DataBenchResult:
    with TokenDataset(options.prefix, seq_len=options.seq_len) as ds:
        if not len(ds):
            raise UsageError(f"{options.prefix}: {ds.total_tokens} tokens hold no sample of "
                             f"{options.seq_len + 1} tokens; lower --seq-len")
        orders = sample_orders(len(ds), shuffled=options.shuffled, sequential=options.sequential,
                               seed=options.seed)
        files = plain_files(ds)
        how = pick_eviction(options.evict)
        if progress is not None:
            progress.update(progress.task_ids[0], total=options.reps * len(orders) * len(readers))
        runs: dict[tuple[str, str], list[DataRun]] = {(o, r.name): [] for o in orders for r in readers}
        for _ in range(options.reps):
            for order_name, order in orders.items():
                for reader in readers:
                    how = evict(files, how)
                    _resident, cache = check_cold(files)
                    cpu, start = cpu_seconds(), time.perf_counter()
                    checksum = reader.read(ds, order, options.batch_size, options.prefetch)
                    runs[order_name, reader.name].append(DataRun(time.perf_counter() - start, cache, checksum,
                                                                 cpu_seconds() - cpu))
                    if progress is not None:
                        progress.advance(progress.task_ids[0])
            ds.close()  # a fresh handle per repetition, as a new training process would have
        rows = tuple(DataRow(order=o, reader=name, call=DATA_READERS[name].call, samples=len(orders[o]),
                             sample_bytes=ds.geometry.sample_bytes, runs=tuple(r))
                     for (o, name), r in runs.items())
    sums = {r.checksum for row in rows for r in row.runs if row.order == "shuffled"}
    if len(sums) > 1 or len({r.checksum for row in rows for r in row.runs if row.order == "sequential"}) > 1:
        raise RuntimeError("the readers disagree on the tokens (different checksums): "
                           + "; ".join(f"{row.order} {row.reader}: {sorted({r.checksum for r in row.runs})}"
                                       for row in rows))
    return DataBenchResult(options=options, dataset=options.prefix, eviction=how, rows=rows,
                           notes=tuple(notes))
