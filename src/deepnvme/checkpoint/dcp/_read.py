"""How NVMeStorageReader reads: probes of large items, slice reads, pooled span buffers.

A DCP data file is a run of ``torch.save`` items. A tensor item of ``PROBE_MIN`` bytes or more
is *probed*: only its first and last ``PROBE`` bytes are read (the zip's local headers and
pickle, and its central directory), which locate its storage record; then only the bytes the
load plan's slice needs are read, straight into the planner's tensor where the slice is one
contiguous run of the same dtype, else into a pooled buffer that is copied from. Smaller
items (and anything the parser declines) are read whole, neighbours coalesced into spans.

Memory: ``buffers x (span + 4 KiB)`` bytes of reused span buffers, plus one fresh buffer for a
whole item or strided slice longer than ``span``; in flight at most ``ahead`` bytes.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from typing import Protocol

import torch

from ...handles.aio import AioHandle, wait_all
from ...io.plan import Span, coalesce
from ...memory.views import aligned_empty
from ._io import TensorLayout, _item_bytes, contiguous_run, parse_layout, slice_extent

__all__ = ["PROBE", "PROBE_MIN", "probe_layouts", "SpanPool", "Job", "SliceJob", "SpanJob",
           "run_jobs"]

PROBE = 4096  # bytes read at each end of a probed item
PROBE_MIN = 1 << 20  # tensor items from this many bytes are probed rather than read whole
_PROBE_SPAN = 1 << 20  # most bytes of neighbouring probe windows read by one request
_ALIGN = 4096


def probe_layouts(handle: AioHandle, path: str, extents: Sequence[tuple[int, int]],
                  keep: list[tuple[memoryview, memoryview]] | None = None) -> list[TensorLayout | None]:
    """Each ``(offset, length)`` item's tensor layout from its head and tail windows, or None
    where it is not a plain ``torch.save(tensor)`` item (the caller reads it whole). Blocks.
    ``keep``: gets each item's (head, tail) window bytes appended."""
    windows: list[tuple[int, int]] = []
    for offset, length in extents:
        n = min(length, PROBE)
        windows += [(offset, n), (offset + length - n, n)]
    spans = coalesce(windows, gap=PROBE, cap=_PROBE_SPAN)
    bufs = [torch.empty(span.end - span.start, dtype=torch.uint8) for span in spans]
    wait_all([handle.submit_read(buf, path, offset=span.start) for span, buf in zip(spans, bufs)])
    where: dict[int, memoryview] = {}
    for span, buf in zip(spans, bufs):
        view = _item_bytes(buf)
        for w in span.members:
            at = windows[w][0] - span.start
            where[w] = view[at:at + windows[w][1]]
    if keep is not None:
        keep += [(where[2 * i], where[2 * i + 1]) for i in range(len(extents))]
    return [parse_layout(where[2 * i], where[2 * i + 1], length - len(where[2 * i + 1]))
            for i, (_offset, length) in enumerate(extents)]


class SpanPool:
    """Up to ``buffers`` reused buffers of ``span`` bytes (plus alignment slack), made on first
    use; each read lands in a view aligned to its file offset so O_DIRECT needs no bounce.
    Not thread-safe (the reading thread only)."""

    def __init__(self, *, span: int, buffers: int) -> None:
        self.span = span
        self._free = buffers
        self._idle: list[torch.Tensor] = []

    def has_room(self) -> bool:
        return self._free > 0 or bool(self._idle)

    def take(self, file_offset: int, nbytes: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A buffer for ``nbytes`` at ``file_offset`` and the pooled storage to :meth:`give`
        back (None for a fresh buffer: too long for the pool, or the pool is empty)."""
        if nbytes > self.span or not self.has_room():
            return aligned_empty(nbytes, file_offset), None
        if self._idle:
            raw = self._idle.pop()
        else:
            self._free -= 1
            raw = torch.empty(self.span + _ALIGN, dtype=torch.uint8)
        pad = (file_offset - raw.data_ptr()) % _ALIGN
        return raw[pad:pad + nbytes], raw

    def give(self, raw: torch.Tensor | None) -> None:
        if raw is not None:
            self._idle.append(raw)


class Job(Protocol):
    """One read of bytes ``[start, end)`` of ``path``. Call order: :meth:`prepare` (may resolve
    a destination), :meth:`buffer` (where the bytes land), then :meth:`finish` once read."""

    path: str
    start: int
    end: int

    def prepare(self) -> bool:
        """Decide where the bytes go; True if they need a span buffer from the pool."""
        ...

    def buffer(self, pool: SpanPool) -> tuple[torch.Tensor, torch.Tensor | None]: ...

    def finish(self, data: torch.Tensor) -> None: ...


class SliceJob:
    """The bytes of one tensor slice of a probed item: read into ``target`` itself when the slice
    is one contiguous run of the target's dtype and the target is a contiguous CPU tensor,
    else the slice's extent into a span buffer that ``copy`` then narrows into the target.
    ``check(bytes)`` runs on the bytes read when they are the item's whole storage record."""

    def __init__(self, path: str, item_offset: int, layout: TensorLayout,
                 offsets: Sequence[int], lengths: Sequence[int], *,
                 resolve: Callable[[], torch.Tensor],
                 copy: Callable[[torch.Tensor, torch.Tensor], None],
                 commit: Callable[[torch.Tensor], None],
                 check: Callable[[torch.Tensor], None] | None = None) -> None:
        self.path = path
        self.layout = layout
        self.offsets, self.lengths = tuple(offsets), tuple(lengths)
        first, nbytes = slice_extent(layout, offsets, lengths)  # ValueError if malformed
        self.start = item_offset + layout.record + first
        self.end = self.start + nbytes
        self._resolve, self._copy, self._commit = resolve, copy, commit
        # the whole storage record read: ``check`` sees its bytes (the target's, read directly)
        self._check = check if first == 0 and nbytes == layout.record_length else None
        self._target: torch.Tensor | None = None
        self.direct = False

    def prepare(self) -> bool:
        target = self._target = self._resolve()
        self.direct = (target.device.type == "cpu" and target.dtype == self.layout.dtype
                       and target.is_contiguous() and tuple(target.size()) == self.lengths
                       and contiguous_run(self.layout, self.offsets, self.lengths) is not None)
        return not self.direct

    def buffer(self, pool: SpanPool) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.direct and self._target is not None:
            return self._target, None
        return pool.take(self.start, self.end - self.start)

    def finish(self, data: torch.Tensor) -> None:
        target = self._target
        if target is None:
            raise RuntimeError("SliceJob.finish before prepare")
        if self._check is not None:
            self._check(data)
        if not self.direct:
            self._copy(data, target)
        self._commit(target)
        self._target = None


class SpanJob:
    """Neighbouring whole items read by one request into a span buffer; ``load(i, bytes)`` is
    called for each member ``i`` with its bytes (valid only during the call)."""

    def __init__(self, path: str, span: Span, extents: Sequence[tuple[int, int]],
                 load: Callable[[int, torch.Tensor], None]) -> None:
        self.path, self.start, self.end = path, span.start, span.end
        self._members = span.members
        self._extents = extents
        self._load = load

    def prepare(self) -> bool:
        return True

    def buffer(self, pool: SpanPool) -> tuple[torch.Tensor, torch.Tensor | None]:
        return pool.take(self.start, self.end - self.start)

    def finish(self, data: torch.Tensor) -> None:
        for i in self._members:
            offset, length = self._extents[i]
            self._load(i, data[offset - self.start:offset - self.start + length])


def run_jobs(handle: AioHandle, jobs: Iterable[Job], *, pool: SpanPool, ahead: int) -> None:
    """Read every job with the engine, in order, at most ``ahead`` bytes in flight (and no more
    pooled buffers than the pool has), finishing each once its bytes are in. On an error the
    reads in flight are waited for before it propagates, so no buffer is written afterwards."""
    pending: collections.deque[tuple[Job, torch.Tensor, torch.Tensor | None, Future[int] | None]]
    pending = collections.deque()
    in_flight = 0

    def retire() -> None:
        nonlocal in_flight
        job, buf, raw, fut = pending.popleft()
        in_flight -= job.end - job.start
        if fut is not None:
            fut.result()
        job.finish(buf)
        pool.give(raw)

    try:
        for job in jobs:
            pooled = job.prepare()
            size = job.end - job.start
            while pending and (in_flight + size > ahead or (pooled and not pool.has_room())):
                retire()
            buf, raw = job.buffer(pool)
            fut = handle.submit_read(buf, job.path, offset=job.start) if size else None
            pending.append((job, buf, raw, fut))
            in_flight += size
        while pending:
            retire()
    except BaseException:
        for _job, _buf, _raw, fut in pending:
            if fut is not None:
                fut.exception()  # waits; the first error is already propagating
        raise
