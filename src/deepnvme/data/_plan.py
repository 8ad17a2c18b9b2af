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

__all__ = ["SampleGeometry", "BatchPlan", "plan_batch", "batch_buffer_bytes", "sample_indices"]


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
    the batch starts at byte ``sample_at[k]`` of the buffer; ``nbytes`` is the sum of ``sizes``."""

    buffer_offsets: torch.Tensor
    file_offsets: torch.Tensor
    sizes: torch.Tensor
    sample_at: torch.Tensor
    buffer_bytes: int
    nbytes: int

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
                   sample_at=torch.tensor([sample_at], dtype=torch.int64), buffer_bytes=nbytes, nbytes=nbytes)


def sample_indices(samples: Sequence[int] | torch.Tensor, count: int) -> torch.Tensor:
    """``samples`` as a 1-D int64 tensor of indices in ``[0, count)`` (negative ones count from
    the end); IndexError naming the first index out of range."""
    idx = torch.as_tensor(samples, dtype=torch.int64).reshape(-1)
    if idx.numel():
        bad = (idx < -count) | (idx >= count)
        if bool(bad.any()):
            first = int(idx[bad][0])
            raise IndexError(f"sample {first} out of range: the dataset has {count} samples")
        idx = idx.remainder(count)
    return idx


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
    starts = idx.mul_(geometry.stride * geometry.itemsize).add_(geometry.base)
    order = torch.argsort(starts, stable=True)
    first = starts[order]
    lo = first - first.remainder(alignment)
    # all samples have one length, so sorted by start their ends never decrease either
    hi = (first + (geometry.sample_bytes + alignment - 1)).floor_divide_(alignment).mul_(alignment)
    hi.clamp_(max=geometry.file_size)
    new = torch.ones(n, dtype=torch.bool)
    new[1:] = lo[1:] > hi[:-1] + gap
    # cap: a read of a run of close samples ends where its samples' starts cross the next
    # multiple of `room` bytes from the run's first byte; `room` leaves space for the widened
    # last sample, so no read exceeds max_read (a sample longer than that is a read of its own)
    widest = align_up(geometry.sample_bytes, alignment) + alignment
    room = max_read - widest
    if room <= 0:
        new[:] = True
    else:
        run = new.cumsum(0).sub_(1)
        run_lo = lo[new][run]
        part = (lo - run_lo).floor_divide_(room)
        new[1:] |= (part[1:] != part[:-1])
    read = new.cumsum(0).sub_(1)
    heads = new.nonzero().squeeze(1)
    tails = torch.empty_like(heads)
    tails[:-1] = heads[1:] - 1
    tails[-1] = n - 1
    file_offsets = lo[heads]
    sizes = hi[tails] - file_offsets
    room_taken = (sizes + (alignment - 1)).floor_divide_(alignment).mul_(alignment)
    ends = room_taken.cumsum(0)
    buffer_offsets = ends - room_taken
    sample_at = torch.empty(n, dtype=torch.int64)
    sample_at[order] = buffer_offsets[read] + first - file_offsets[read]
    return BatchPlan(buffer_offsets=buffer_offsets, file_offsets=file_offsets, sizes=sizes, sample_at=sample_at,
                     buffer_bytes=int(ends[-1]), nbytes=int(sizes.sum()))


def batch_buffer_bytes(batch_size: int, geometry: SampleGeometry, *, alignment: int, gap: int) -> int:
    """Upper bound of :attr:`BatchPlan.buffer_bytes` for ``batch_size`` samples: each sample
    widened to alignment takes at most ``align_up(sample_bytes, alignment) + alignment`` bytes,
    plus a hole of at most ``gap`` bytes before it."""
    return batch_size * (align_up(geometry.sample_bytes, alignment) + alignment + align_up(gap, alignment))
