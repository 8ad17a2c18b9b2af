"""Pure planning of where each block's tensors live in files and in the staging buffer.

No I/O here: functions map (file, offset, length) records to read spans and buffer offsets,
so the alignment rules are unit-tested without a disk.

Rules: a staging buffer starts page aligned; each read span starts at a file offset rounded
down to ``align`` and lands at a buffer offset that is a multiple of ``align``, so O_DIRECT
reads go straight into the buffer; a tensor's bytes therefore keep their file offset modulo
``align`` inside the buffer (dtype views stay aligned as long as the file is aligned for them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ..io.plan import align_down, align_up
from ..io.volume import VolumePath

__all__ = ["TensorRecord", "Span", "BlockPlan", "plan_block_reads", "plan_packed_block",
           "align_up", "align_down", "TENSOR_ALIGN", "FILE_ALIGN"]

FILE_ALIGN = 4096   # block starts and read spans: the O_DIRECT offset/size granularity
TENSOR_ALIGN = 64   # tensors inside a packed block: enough for any dtype view and for SIMD loads
_MAX_GAP_OVERHEAD = 0.25  # merge a file's tensors into one span unless gaps add >25% bytes


@dataclasses.dataclass(frozen=True)
class TensorRecord:
    """Where one tensor's bytes are: ``nbytes`` at ``offset`` of ``file``; ``key`` names it."""

    key: str
    file: str
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Span:
    """One read: ``nbytes`` at ``file_offset`` of ``file`` into the buffer at ``buffer_offset``."""

    file: str | VolumePath
    file_offset: int
    nbytes: int
    buffer_offset: int


@dataclasses.dataclass(frozen=True)
class BlockPlan:
    """The reads that fill one block's staging buffer and where each tensor then sits in it."""

    spans: tuple[Span, ...]
    tensor_offsets: dict[str, int]
    buffer_bytes: int

    @property
    def read_bytes(self) -> int:
        return sum(s.nbytes for s in self.spans)


def _group_spans(records: Sequence[TensorRecord], align: int) -> list[list[TensorRecord]]:
    """Split one file's records (sorted by offset) into runs worth reading as one span."""
    runs: list[list[TensorRecord]] = []
    for rec in records:
        if runs:
            run = runs[-1]
            start = align_down(run[0].offset, align)
            end = align_up(max(rec.offset + rec.nbytes, max(r.offset + r.nbytes for r in run)), align)
            useful = sum(r.nbytes for r in run) + rec.nbytes
            if end - start <= useful * (1 + _MAX_GAP_OVERHEAD) + 2 * align:
                run.append(rec)
                continue
        runs.append([rec])
    return runs


def plan_block_reads(records: Sequence[TensorRecord], file_sizes: dict[str, int], *,
                     align: int = FILE_ALIGN) -> BlockPlan:
    """Plan the reads of one block from files whose layout we do not control (e.g. safetensors).

    Tensors of the same file that lie close together become one span; spans are widened to
    ``align`` boundaries (clipped at end of file) so reads are O_DIRECT-able.
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    by_file: dict[str, list[TensorRecord]] = {}
    for rec in records:
        size = file_sizes[rec.file]
        if rec.offset < 0 or rec.nbytes < 0 or rec.offset + rec.nbytes > size:
            raise ValueError(f"tensor {rec.key!r} ({rec.nbytes} bytes at offset {rec.offset}) "
                             f"lies outside {rec.file!r} ({size} bytes)")
        by_file.setdefault(rec.file, []).append(rec)
    spans: list[Span] = []
    offsets: dict[str, int] = {}
    cursor = 0
    for file in sorted(by_file):
        for run in _group_spans(sorted(by_file[file], key=lambda r: r.offset), align):
            start = align_down(run[0].offset, align)
            end = min(align_up(max(r.offset + r.nbytes for r in run), align), file_sizes[file])
            spans.append(Span(file, start, end - start, cursor))
            for rec in run:
                offsets[rec.key] = cursor + rec.offset - start
            cursor = align_up(cursor + end - start, align)
    return BlockPlan(tuple(spans), offsets, max(cursor, align))


def plan_packed_block(sizes: Sequence[tuple[str, int]], *, tensor_align: int = TENSOR_ALIGN,
                      file_align: int = FILE_ALIGN) -> tuple[dict[str, int], int]:
    """Pack tensors ``(key, nbytes)`` back to back at ``tensor_align`` offsets.

    Returns ``(offsets, block_bytes)`` where ``block_bytes`` is rounded up to ``file_align``
    so consecutive blocks in one file all start aligned (one O_DIRECT read per block).
    """
    offsets: dict[str, int] = {}
    cursor = 0
    for key, nbytes in sizes:
        if key in offsets:
            raise ValueError(f"tensor {key!r} listed twice")
        offsets[key] = cursor
        cursor = align_up(cursor + nbytes, tensor_align)
    return offsets, max(align_up(cursor, file_align), file_align)
