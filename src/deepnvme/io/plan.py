"""Pure planning: cut a transfer into chunks and decide how each one reaches the disk.

No I/O happens here. A request of ``size`` bytes at ``file_offset`` from/to memory at ``address``
becomes an unaligned head, an aligned middle in ``block_size`` chunks and an unaligned tail:

* ``BUFFERED`` chunks go through a descriptor without O_DIRECT (the ragged edges, or all of a
  request when O_DIRECT is off or refused);
* ``DIRECT`` chunks go straight between the caller's memory and the disk;
* ``BOUNCE`` chunks are aligned in the file but not in memory: they pass through an aligned
  bounce buffer with O_DIRECT.
"""

from __future__ import annotations

import dataclasses
import enum
import mmap
from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["Kind", "Chunk", "Alignment", "Span", "align_down", "align_up", "coalesce", "plan_transfer",
           "PAGE_SIZE"]

PAGE_SIZE = mmap.PAGESIZE


class Kind(enum.Enum):
    DIRECT = "direct"
    BOUNCE = "bounce"
    BUFFERED = "buffered"


class Chunk(NamedTuple):
    """``length`` bytes at ``buf_offset`` in the caller's buffer <-> ``file_offset`` in the file.

    A named tuple rather than a frozen dataclass: a batch of small reads makes one per item,
    and a tuple is built several times faster.
    """

    buf_offset: int
    file_offset: int
    length: int
    kind: Kind


@dataclasses.dataclass(frozen=True)
class Alignment:
    """O_DIRECT constraints of one file: memory address and file offset/length alignment (bytes)."""

    memory: int
    offset: int

    def __post_init__(self) -> None:
        for name in ("memory", "offset"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} alignment must be a positive power of two, got {value}")


def align_down(value: int, alignment: int) -> int:
    return value - value % alignment


def align_up(value: int, alignment: int) -> int:
    return -(-value // alignment) * alignment


def _split(start: int, end: int, block: int, base_offset: int, kind: Kind) -> list[Chunk]:
    return [Chunk(pos - base_offset, pos, min(block, end - pos), kind)
            for pos in range(start, end, block)]


def plan_transfer(*, size: int, file_offset: int, address: int, block_size: int,
                  alignment: Alignment | None) -> list[Chunk]:
    """Chunks covering exactly ``[file_offset, file_offset + size)`` in file order.

    ``alignment=None`` means O_DIRECT is not used: every chunk is ``BUFFERED``. Edges are
    widened to at least the page size so that a buffered edge and a direct chunk of the same
    request never share a page of the page cache. Raises ``ValueError`` for negative inputs.
    """
    if size < 0 or file_offset < 0 or address < 0:
        raise ValueError(f"size, file_offset and address must be >= 0, got {size}, "
                         f"{file_offset}, {address}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    end = file_offset + size
    if (alignment is not None and 0 < size <= block_size and file_offset % alignment.offset == 0
            and size % alignment.offset == 0 and file_offset % PAGE_SIZE == 0
            and size % PAGE_SIZE == 0):  # the common small aligned read: one chunk, no splitting
        kind = Kind.DIRECT if address % alignment.memory == 0 else Kind.BOUNCE
        return [Chunk(0, file_offset, size, kind)]
    if alignment is None:
        return _split(file_offset, end, block_size, file_offset, Kind.BUFFERED)
    edge = max(alignment.offset, PAGE_SIZE)
    block = max(align_down(block_size, edge), edge)
    mid_start = min(align_up(file_offset, edge), end)
    mid_end = max(align_down(end, edge), mid_start)
    chunks = _split(file_offset, mid_start, block, file_offset, Kind.BUFFERED)
    if mid_end > mid_start:
        mem_ok = (address + mid_start - file_offset) % alignment.memory == 0
        chunks += _split(mid_start, mid_end, block, file_offset,
                         Kind.DIRECT if mem_ok else Kind.BOUNCE)
    chunks += _split(mid_end, end, block, file_offset, Kind.BUFFERED)
    return chunks


@dataclasses.dataclass(frozen=True)
class Span:
    """One read request: bytes ``[start, end)`` of a file covering the items at ``members``."""

    start: int
    end: int
    members: tuple[int, ...]


def coalesce(ranges: Sequence[tuple[int, int]], *, gap: int, cap: int) -> list[Span]:
    """Group ``(offset, length)`` ranges (indices kept) into spans read with one request each.

    Ranges sorted by offset join the current span while the hole before them is at most
    ``gap`` bytes and the span stays within ``cap`` bytes; a range longer than ``cap`` is a
    span of its own. Overlapping ranges share a span.
    """
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    spans: list[Span] = []
    start = end = -1
    members: list[int] = []
    for i in order:
        off, length = ranges[i]
        if members and off - end <= gap and max(end, off + length) - start <= cap:
            end = max(end, off + length)
            members.append(i)
            continue
        if members:
            spans.append(Span(start, end, tuple(members)))
        start, end, members = off, off + length, [i]
    if members:
        spans.append(Span(start, end, tuple(members)))
    return spans
