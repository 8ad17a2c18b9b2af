"""Which kernel mover ``engine="auto"`` gives one transfer: pure functions, no I/O.

Where both io_uring and Linux AIO run, ``auto`` does not bind a handle to one of them: each
request (or batch) is classed by what it is (:func:`classify`) and goes to the mover that is
fast for that class (:data:`PREFERENCES`, first available wins). The classes follow where the
two differ in kind, not by a few percent:

- Linux AIO is synchronous where the kernel cannot queue the transfer: on buffered
  descriptors and for writes that extend the file (``io_submit`` returns only once the data
  moved), so a worker's queue depth collapses to one. io_uring hands those to its kernel
  workers and keeps the queue full, at about twice Linux AIO's CPU per byte: with one worker
  it is several times faster; with two or more workers, each holding one synchronous write,
  Linux AIO keeps up and spends less, so file-extending writes go to it there.
- For large direct reads and overwrites, and for many small direct reads or writes, both
  queue in the kernel; the measured winner is listed first.
- A large direct transfer of a page-locked buffer that moved data before (a training job's swap
  and staging buffers, reused every step) goes to io_uring, where the kernel registers buffers:
  the ring registers the buffer once, so no request pins its pages again, and it moves the same
  bytes at the same rate as Linux AIO for about half its CPU. A buffer's first transfer stays
  with Linux AIO: registering pins the whole buffer, which only pays back from the second use.

A single direct write past the file's end is made an overwrite before it is classed: the
engine grows the file to the write's end first (``fallocate``), where the filesystem can, so
the file-extending classes are left to batches that extend the file and to filesystems that
cannot allocate ahead.

The engine asks :func:`choose` per request; ``deepnvme report`` and ``tune`` print
:func:`auto_choices`, the same table with the reasons.
"""

from __future__ import annotations

import dataclasses

__all__ = ["TransferShape", "Choice", "classify", "choose", "auto_choices", "PREFERENCES",
           "SMALL_BYTES", "KERNEL_MOVERS", "EXTENDING", "EXTENDING_MANY"]

#: the movers auto chooses between per transfer (the thread mover is only a fallback)
KERNEL_MOVERS = ("io_uring", "aio")
#: a transfer whose largest chunk is below this is "small" (per-request cost dominates)
SMALL_BYTES = 64 << 10

BUFFERED = "buffered"
EXTENDING = "file-extending write, 1 worker"
EXTENDING_MANY = "file-extending write, 2+ workers"
SMALL_READ = "small direct reads"
SMALL_WRITE = "small direct writes"
LARGE_READ = "large direct read"
LARGE_WRITE = "large direct overwrite"
REUSED_READ = "large direct read, reused locked buffer"
REUSED_WRITE = "large direct overwrite, reused locked buffer"

_MEASURED = "measured faster for it (benchmarks/bench_engines.py; LOG.md, issue 28)"
_SMALL_READS = ("measured: 0.75x Linux AIO's CPU per read at 1.02-1.15x its IOPS (4 KiB random reads, "
                "depth 32; benchmarks/bench_perread.py, LOG.md 2026-12-07)")
_REGISTERED = ("the buffer is registered with the ring once, no page pinning per request: the "
               "same rate as Linux AIO at about half its CPU per byte (measured, --reuse)")

#: transfer class -> (mover, why) in order of preference
PREFERENCES: dict[str, tuple[tuple[str, str], ...]] = {
    BUFFERED: (("io_uring", "no O_DIRECT: Linux AIO runs it synchronously, io_uring queues it"),
               ("aio", "io_uring unavailable")),
    EXTENDING: (("io_uring", "past the file's end: Linux AIO runs it synchronously, io_uring "
                             "queues it"),
                ("aio", "io_uring unavailable")),
    EXTENDING_MANY: (("aio", "past the file's end: Linux AIO runs it synchronously, but one "
                             "chunk per worker keeps up with io_uring at half its CPU "
                             "(measured)"),
                     ("io_uring", "Linux AIO unavailable")),
    SMALL_READ: (("io_uring", _SMALL_READS), ("aio", "io_uring unavailable")),
    SMALL_WRITE: (("aio", _MEASURED), ("io_uring", "Linux AIO unavailable")),
    LARGE_READ: (("aio", _MEASURED), ("io_uring", "Linux AIO unavailable")),
    LARGE_WRITE: (("aio", _MEASURED), ("io_uring", "Linux AIO unavailable")),
    REUSED_READ: (("io_uring", _REGISTERED), ("aio", "io_uring unavailable")),
    REUSED_WRITE: (("io_uring", _REGISTERED), ("aio", "io_uring unavailable")),
}


@dataclasses.dataclass(frozen=True)
class TransferShape:
    """What the choice looks at: a write or a read; whether every chunk is on an O_DIRECT
    descriptor; whether a write ends past the file's current size; the largest chunk (bytes);
    the handle's worker threads per mover (``intra_op_parallelism``); whether the memory is a
    page-locked allocation that moved data before and that io_uring can register here."""

    write: bool
    direct: bool
    extending: bool
    largest: int
    workers: int = 1
    reused: bool = False


@dataclasses.dataclass(frozen=True)
class Choice:
    """The mover for one class of transfer, and why."""

    transfer: str
    mover: str
    why: str


def classify(shape: TransferShape) -> str:
    """The class of a transfer (a key of :data:`PREFERENCES`); the synchronous cases first."""
    if not shape.direct:
        return BUFFERED
    if shape.write and shape.extending:
        return EXTENDING if shape.workers <= 1 else EXTENDING_MANY
    if shape.largest < SMALL_BYTES:
        return SMALL_WRITE if shape.write else SMALL_READ
    if shape.reused:
        return REUSED_WRITE if shape.write else REUSED_READ
    return LARGE_WRITE if shape.write else LARGE_READ


def _pick(transfer: str, available: tuple[str, ...]) -> Choice:
    for mover, why in PREFERENCES[transfer]:
        if mover in available:
            return Choice(transfer, mover, why)
    raise ValueError(f"none of {[m for m, _ in PREFERENCES[transfer]]} is in {list(available)}")


def choose(shape: TransferShape, available: tuple[str, ...]) -> Choice:
    """The mover among ``available`` (names of :data:`KERNEL_MOVERS`) for ``shape``.
    ValueError if none of them is (the engine only asks with at least one)."""
    return _pick(classify(shape), available)


def auto_choices(available: tuple[str, ...], registers: bool = True) -> tuple[Choice, ...]:
    """The mover ``auto`` takes for every class of transfer with ``available`` movers (empty
    when neither kernel mover runs: then ``auto`` is the thread mover for everything);
    without ``registers`` (io_uring here cannot register buffers) the reused-buffer classes,
    which then never occur, are left out."""
    have = tuple(m for m in available if m in KERNEL_MOVERS)
    if not have:
        return ()
    return tuple(_pick(transfer, have) for transfer in PREFERENCES
                 if registers or transfer not in (REUSED_READ, REUSED_WRITE))
