"""Pure read planning for token samples: sample index -> byte range -> aligned, coalesced reads.

A sample ``i`` is tokens ``[i x seq_len, i x seq_len + seq_len + 1)`` of the concatenation,
bytes ``[base + i x seq_len x itemsize, ... + (seq_len + 1) x itemsize)`` of the .bin. A
batch's ranges are widened to the O_DIRECT alignment, coalesced with their neighbours (overlap,
or holes up to ``gap`` bytes) into reads of at most ``max_read`` bytes, and laid out back to
back in one buffer. No I/O here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..io.plan import align_up, coalesce

__all__ = ["SampleGeometry", "BatchPlan", "plan_batch", "batch_buffer_bytes"]


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


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The reads of one batch into one buffer of ``buffer_bytes``: ``reads`` are
    ``(buffer_offset, file_offset, nbytes)``; sample ``k`` of the batch starts at byte
    ``sample_at[k]`` of the buffer."""

    reads: tuple[tuple[int, int, int], ...]
    sample_at: tuple[int, ...]
    buffer_bytes: int


def plan_batch(samples: Sequence[int], geometry: SampleGeometry, *, alignment: int, max_read: int,
               gap: int) -> BatchPlan:
    """Plan the reads of ``samples`` (indices, any order, repeats allowed, negative ones count
    from the end). Reads start and end on ``alignment`` boundaries except where the file ends;
    each holds at most ``max_read`` bytes unless one sample alone is larger."""
    count = geometry.count
    if samples and not (-count <= min(samples) and max(samples) < count):
        bad = next(i for i in samples if not -count <= i < count)
        raise IndexError(f"sample {bad} out of range: the dataset has {count} samples")
    step, nbytes, size = geometry.stride * geometry.itemsize, geometry.sample_bytes, geometry.file_size
    starts = [geometry.base + (int(i) % count) * step for i in samples]
    ranges = [(s - s % alignment, min(align_up(s + nbytes, alignment), size) - s + s % alignment)
              for s in starts]
    reads = []
    sample_at = [0] * len(starts)
    cursor = 0
    for span in coalesce(ranges, gap=gap, cap=max_read):
        reads.append((cursor, span.start, span.end - span.start))
        for k in span.members:
            sample_at[k] = cursor + starts[k] - span.start
        cursor += align_up(span.end - span.start, alignment)
    return BatchPlan(reads=tuple(reads), sample_at=tuple(sample_at), buffer_bytes=cursor)


def batch_buffer_bytes(batch_size: int, geometry: SampleGeometry, *, alignment: int, gap: int) -> int:
    """Upper bound of :attr:`BatchPlan.buffer_bytes` for ``batch_size`` samples: each sample
    widened to alignment takes at most ``align_up(sample_bytes, alignment) + alignment`` bytes,
    plus a hole of at most ``gap`` bytes before it."""
    return batch_size * (align_up(geometry.sample_bytes, alignment) + alignment + align_up(gap, alignment))
