"""Pure read planning for token samples: sample indices -> byte ranges -> aligned, coalesced reads.

A sample ``i`` is tokens ``[i x seq_len, i x seq_len + seq_len + 1)`` of the concatenation,
bytes ``[base + i x seq_len x itemsize, ... + (seq_len + 1) x itemsize)`` of the .bin. A
batch's ranges are widened to the O_DIRECT alignment, coalesced with their neighbours (overlap,
or holes up to ``gap`` bytes) into reads of at most ``max_read`` bytes, and laid out back to
back in one buffer. No I/O here.

The plan is computed with a fixed number of tensor operations per batch over int64 tensors (one
element per sample or read), never a Python object per sample: a batch of shuffled samples
costs the same few calls as one sample.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ..io.plan import align_up

__all__ = ["SampleGeometry", "BatchPlan", "plan_batch", "plan_apart", "plan_runs", "batch_buffer_bytes",
           "sample_indices"]


@dataclasses.dataclass(frozen=True)
class SampleGeometry:
    """Where samples lie: ``count`` samples of ``tokens`` tokens (seq_len + 1), ``stride``
    tokens apart, of ``itemsize`` bytes each, from byte ``base`` of a ``file_size``-byte file."""

    base: int
    itemsize: int
    stride: int
    tokens: int
    count: int
    file_size: int

    @property
    def sample_bytes(self) -> int:
        return self.tokens * self.itemsize

    def byte_range(self, i: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of sample ``i`` in the file (IndexError when out of range)."""
        if not -self.count <= i < self.count:
            raise IndexError(f"sample {i} out of range: the dataset has {self.count} samples")
        i %= self.count
        return self.base + i * self.stride * self.itemsize, self.sample_bytes


@dataclasses.dataclass(frozen=True, eq=False)
class BatchPlan:
    """The reads of one batch into one buffer of ``buffer_bytes``, as 1-D int64 tensors with one
    element per read: ``buffer_offsets``, ``file_offsets`` and ``sizes`` (bytes); sample ``k`` of
    the batch starts at byte ``sample_at[k]`` of the buffer; ``nbytes`` is the sum of ``sizes``;
    ``step``: the bytes between consecutive samples in the buffer when they are evenly spaced
    (sequential order, where they can be copied out with one strided view), else None;
    ``bounds``, where the planner knows them (:func:`plan_apart`): the lowest file offset, the
    end (largest offset + size), the smallest and largest size, and a power of two dividing
    every buffer offset, file offset and size, exact, so the reads need no second check."""

    buffer_offsets: torch.Tensor
    file_offsets: torch.Tensor
    sizes: torch.Tensor
    sample_at: torch.Tensor
    buffer_bytes: int
    nbytes: int
    step: int | None = None
    bounds: tuple[int, int, int, int, int] | None = None

    @property
    def reads(self) -> tuple[tuple[int, int, int], ...]:
        """``(buffer_offset, file_offset, nbytes)`` of every read (Python ints; for checks and
        messages, not the hot path)."""
        return tuple(zip(self.buffer_offsets.tolist(), self.file_offsets.tolist(), self.sizes.tolist()))

    @classmethod
    def single(cls, file_offset: int, nbytes: int, sample_at: int) -> BatchPlan:
        """One read of ``nbytes`` at ``file_offset`` into the start of the buffer."""
        return cls(buffer_offsets=torch.zeros(1, dtype=torch.int64),
                   file_offsets=torch.tensor([file_offset], dtype=torch.int64),
                   sizes=torch.tensor([nbytes], dtype=torch.int64),
                   sample_at=torch.tensor([sample_at], dtype=torch.int64), buffer_bytes=nbytes, nbytes=nbytes,
                   step=0)


_RUN_CHECK = 4096  # batches up to this size are checked for consecutive samples
_NEAR_SHARE = 8  # plan_apart plans a row with up to 1 in this many samples close to another


def sample_indices(samples: Sequence[int] | torch.Tensor, count: int) -> torch.Tensor:
    """``samples`` as a 1-D int64 tensor of indices in ``[0, count)`` (negative ones count from
    the end; may be ``samples`` itself, not to be modified); IndexError naming the first index out
    of range."""
    idx = torch.as_tensor(samples, dtype=torch.int64).reshape(-1)
    if not idx.numel():
        return idx
    low, high = (int(v) for v in torch.aminmax(idx))
    if low >= 0 and high < count:
        return idx
    bad = (idx < -count) | (idx >= count)
    if bool(bad.any()):
        first = int(idx[bad][0])
        raise IndexError(f"sample {first} out of range: the dataset has {count} samples")
    return idx.remainder(count)


def plan_batch(samples: Sequence[int] | torch.Tensor, geometry: SampleGeometry, *, alignment: int,
               max_read: int, gap: int) -> BatchPlan:
    """Plan the reads of ``samples`` (indices, any order, repeats allowed, negative ones count
    from the end; a sequence of ints or an integer tensor). Reads start and end on ``alignment``
    boundaries except where the file ends; each holds at most ``max_read`` bytes unless one
    sample alone is larger. IndexError for an index out of range."""
    idx = sample_indices(samples, geometry.count)
    n = idx.numel()
    if not n:
        empty = torch.zeros(0, dtype=torch.int64)
        return BatchPlan(buffer_offsets=empty, file_offsets=empty, sizes=empty, sample_at=empty,
                         buffer_bytes=0, nbytes=0)
    step = geometry.stride * geometry.itemsize
    if 1 < n <= _RUN_CHECK:  # sequential order? checked on a list: one conversion, C-speed compares
        ids = idx.tolist()
        d = ids[1] - ids[0]
        if 0 <= d * step <= geometry.sample_bytes and (ids.count(ids[0]) == n if d == 0 else
                                                       ids == list(range(ids[0], ids[0] + n * d, d))):
            return _plan_run(geometry.base + ids[0] * step, d * step, n, geometry, alignment=alignment,
                             max_read=max_read)
    starts = idx * step + geometry.base
    order = torch.argsort(starts, stable=True)
    first = starts.index_select(0, order)
    into = first.remainder(alignment)  # each sample's offset in its first aligned block
    lo = first - into
    # all samples have one length, so sorted by start their ends never decrease either
    hi = (first + (geometry.sample_bytes + alignment - 1)).floor_divide_(alignment).mul_(alignment)
    hi.clamp_(max=geometry.file_size)
    joined = (lo.narrow(0, 1, n - 1) - hi.narrow(0, 0, n - 1)) <= gap  # sample k+1 joins k's read
    # cap: a read of a run of close samples ends where its samples' starts cross the next
    # multiple of `room` bytes from the run's first byte; `room` leaves space for the widened
    # last sample, so no read exceeds max_read (a sample longer than that is a read of its own)
    room = max_read - (align_up(geometry.sample_bytes, alignment) + alignment)
    together = bool(joined.any()) and room > 0
    if together and int(hi[-1] - lo[0]) > max_read:
        run = torch.cat([torch.zeros(1, dtype=torch.int64), (~joined).cumsum(0)])
        run_lo = lo.masked_select(torch.cat([torch.ones(1, dtype=torch.bool), ~joined])).index_select(0, run)
        part = (lo - run_lo).floor_divide_(room)
        joined &= part.narrow(0, 1, n - 1) == part.narrow(0, 0, n - 1)
    if together:  # runs of samples share reads
        new = torch.cat([torch.ones(1, dtype=torch.bool), ~joined])
        read = new.cumsum(0).sub_(1)
        heads = new.nonzero().squeeze(1)
        tails = torch.cat([heads.narrow(0, 1, heads.numel() - 1) - 1, torch.tensor([n - 1])])
        file_offsets = lo.index_select(0, heads)
        sizes = hi.index_select(0, tails) - file_offsets
    else:  # a read per sample (shuffled samples of a large file)
        file_offsets, sizes = lo, hi - lo
    room_taken = (sizes + (alignment - 1)).floor_divide_(alignment).mul_(alignment)
    ends = room_taken.cumsum(0)
    buffer_offsets = ends - room_taken
    if together:
        sorted_at = buffer_offsets.index_select(0, read) + (first - file_offsets.index_select(0, read))
    else:
        sorted_at = buffer_offsets + into
    sample_at = torch.empty(n, dtype=torch.int64).index_copy_(0, order, sorted_at)
    return BatchPlan(buffer_offsets=buffer_offsets, file_offsets=file_offsets, sizes=sizes, sample_at=sample_at,
                     buffer_bytes=int(ends[-1]), nbytes=int(sizes.sum()),
                     step=_even_step(sample_at, geometry.itemsize))


def plan_apart(idx: torch.Tensor, geometry: SampleGeometry, *, alignment: int,
               gap: int) -> list[BatchPlan | None]:
    """Plans of the rows of ``idx`` (a ``[rows, n]`` int64 tensor of indices in ``[0, count)``,
    checked by the caller; ``alignment`` a power of two) with a fixed number of tensor operations
    for all rows at once: one read per sample, in the row's order, each in a slot of
    ``align_up(sample_bytes, alignment) + alignment`` buffer bytes (within
    :func:`batch_buffer_bytes`). Samples that lie close (sorted starts nearer than a sample plus
    ``gap`` plus two alignment units, repeats included) are read once each, as any other: a row
    with more than :data:`_NEAR_SHARE` of them (an order with locality, where shared reads save
    I/O) or whose reads meet the end of the file gets None: :func:`plan_batch` plans it. Where
    samples lie a whole number of alignment units apart in the file, each starts at the same byte
    of its slot: the plans' ``step`` is the slot (their samples are one strided view)."""
    rows, n = idx.shape
    sb, step = geometry.sample_bytes, geometry.stride * geometry.itemsize
    slot = align_up(sb, alignment) + alignment
    starts = idx.mul(step).add_(geometry.base)
    into = starts.bitwise_and(alignment - 1)  # each sample's offset in its first aligned block
    lo = starts - into
    sizes = (into + (sb + alignment - 1)).bitwise_and_(-alignment)
    columns = [lo.amin(1), (lo + sizes).amax(1), sizes.amin(1), sizes.amax(1), sizes.sum(1)]
    apart = sb + gap + 2 * alignment
    if n > 1:  # the neighbours of each row that may share a read
        columns.append(starts.sort(dim=1).values.diff(dim=1).lt_(apart).sum(1))
    stats = torch.stack(columns, 1).tolist()
    buffer_offsets = torch.arange(0, n * slot, slot, dtype=torch.int64)
    sample_at = into.add_(buffer_offsets)
    even = slot if step % alignment == 0 else None  # every `into` is base % alignment then
    plans: list[BatchPlan | None] = []
    for r, (lowest, end, smallest, largest, nbytes, *near) in enumerate(stats):
        if end > geometry.file_size or (near and near[0] * _NEAR_SHARE > n):
            plans.append(None)
            continue
        plans.append(BatchPlan(buffer_offsets=buffer_offsets, file_offsets=lo[r], sizes=sizes[r],
                               sample_at=sample_at[r], buffer_bytes=n * slot, nbytes=nbytes, step=even,
                               bounds=(lowest, end, smallest, largest, alignment)))
    return plans


def plan_runs(idx: torch.Tensor, geometry: SampleGeometry, *, alignment: int,
              max_read: int) -> list[BatchPlan | None]:
    """Plans of the rows of ``idx`` (a ``[rows, n]`` int64 tensor of indices in ``[0, count)``,
    checked by the caller; ``alignment`` a power of two) that are runs of consecutive samples
    (``i, i + 1, ...``, each overlapping or touching the next: sequential order), with a fixed
    number of tensor operations for all rows at once: the row's whole aligned span read into
    the start of the buffer, in reads of ``max_read`` bytes rounded down to the alignment (the
    last one shorter), the samples ``stride x itemsize`` bytes apart there (``step``: one
    strided view), the exact ``bounds`` known. None for every other row, and for a run whose
    reads would meet the end of the file (:func:`plan_batch` plans those)."""
    rows, n = idx.shape
    step = geometry.stride * geometry.itemsize
    most = max_read - max_read % alignment
    if n < 2 or step > geometry.sample_bytes or most <= 0:
        return [None] * rows
    starts = idx.select(1, 0).mul(step).add_(geometry.base)
    into = starts.bitwise_and(alignment - 1)  # the first sample's offset in its aligned block
    lo = starts - into
    sizes = (into + ((n - 1) * step + geometry.sample_bytes + alignment - 1)).bitwise_and_(-alignment)
    run = idx.sub(idx.narrow(1, 0, 1)).eq_(torch.arange(n, dtype=torch.int64)).all(1)
    stats = torch.stack([run.to(torch.int64), lo, sizes, into], 1).tolist()
    zero = torch.zeros(1, dtype=torch.int64)
    ramps: dict[int, torch.Tensor] = {}  # sample_at by the first sample's offset in its block
    plans: list[BatchPlan | None] = []
    for r, (is_run, low, size, at) in enumerate(stats):
        if not is_run or low + size > geometry.file_size:
            plans.append(None)
            continue
        sample_at = ramps.get(at)
        if sample_at is None:
            sample_at = ramps[at] = torch.arange(at, at + n * step, step, dtype=torch.int64)
        if size <= most:  # one read: views of the block's columns
            at_buffer, file_offsets, read_sizes, smallest = zero, lo.narrow(0, r, 1), sizes.narrow(0, r, 1), size
        else:
            at_buffer = torch.arange(0, size, most, dtype=torch.int64)
            file_offsets = at_buffer + low
            smallest = size - (at_buffer.numel() - 1) * most
            read_sizes = torch.full_like(at_buffer, most)
            read_sizes[-1] = smallest
        plans.append(BatchPlan(buffer_offsets=at_buffer, file_offsets=file_offsets, sizes=read_sizes,
                               sample_at=sample_at, buffer_bytes=size, nbytes=size, step=step,
                               bounds=(low, low + size, smallest, min(size, most), alignment)))
    return plans


def _plan_run(s0: int, step: int, n: int, geometry: SampleGeometry, *, alignment: int,
              max_read: int) -> BatchPlan:
    """The plan of ``n`` samples starting at byte ``s0``, ``step`` bytes apart, each overlapping
    or touching the next (sequential order): a read per ``max_read`` bytes, planned with a few
    integer operations per read instead of tensor operations per sample."""
    sb, size = geometry.sample_bytes, geometry.file_size
    buffer_offsets, file_offsets, sizes, parts = [], [], [], []
    cursor = j = 0
    while j < n:
        lo = s0 + j * step
        lo -= lo % alignment
        # the last sample k whose aligned end stays within max_read bytes of lo (at least j)
        limit = lo + max_read - max_read % alignment
        k = n - 1 if step == 0 else min(n - 1, max(j, (limit - sb - s0) // step))
        hi = min(align_up(s0 + k * step + sb, alignment), size)
        buffer_offsets.append(cursor)
        file_offsets.append(lo)
        sizes.append(hi - lo)
        parts.append(torch.arange(j, k + 1, dtype=torch.int64).mul_(step).add_(cursor + s0 - lo))
        cursor += align_up(hi - lo, alignment)
        j = k + 1
    return BatchPlan(buffer_offsets=torch.tensor(buffer_offsets, dtype=torch.int64),
                     file_offsets=torch.tensor(file_offsets, dtype=torch.int64),
                     sizes=torch.tensor(sizes, dtype=torch.int64),
                     sample_at=parts[0] if len(parts) == 1 else torch.cat(parts), buffer_bytes=cursor,
                     nbytes=sum(sizes), step=step if len(parts) == 1 else None)


def _even_step(sample_at: torch.Tensor, itemsize: int) -> int | None:
    """The bytes between consecutive samples of the buffer when they are all equally spaced
    (a whole number of tokens, not negative), else None."""
    if sample_at.numel() < 2:
        return 0
    step = sample_at.narrow(0, 1, sample_at.numel() - 1) - sample_at.narrow(0, 0, sample_at.numel() - 1)
    first = int(step[0])
    if first < 0 or first % itemsize or not bool((step == first).all()):
        return None
    return first


def batch_buffer_bytes(batch_size: int, geometry: SampleGeometry, *, alignment: int, gap: int) -> int:
    """Upper bound of :attr:`BatchPlan.buffer_bytes` for ``batch_size`` samples: each sample
    widened to alignment takes at most ``align_up(sample_bytes, alignment) + alignment`` bytes,
    plus a hole of at most ``gap`` bytes before it."""
    return batch_size * (align_up(geometry.sample_bytes, alignment) + alignment + align_up(gap, alignment))
