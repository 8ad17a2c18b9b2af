"""Pure planning for NVMe optimizer offload: sub-group partitions and packed state layouts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..io.plan import align_up

__all__ = ["StateEntry", "StateLayout", "partition", "plan_layout", "slice_spans", "ALIGN", "swapped"]

ALIGN = 64  # bytes between packed state tensors: keeps every view aligned for any dtype/SIMD


def swapped(value: object) -> bool:
    """State values that go to NVMe: tensors with at least one dimension and one element (0-d
    tensors such as Adam's ``step``, numbers and None stay in ``optimizer.state``)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() > 0


def _align(n: int) -> int:
    return align_up(n, ALIGN)


def partition(sizes: Sequence[int], sub_group_bytes: int) -> list[range]:
    """Cut consecutive items of ``sizes`` (bytes each) into runs of at most ``sub_group_bytes``.

    Items are never split: one larger than the limit forms a run of its own. Returns ranges of
    item indices covering ``0..len(sizes)`` in order.
    """
    if sub_group_bytes < 1:
        raise ValueError(f"sub_group_bytes must be >= 1, got {sub_group_bytes}")
    runs: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > sub_group_bytes:
            runs.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        runs.append(range(start, len(sizes)))
    return runs


def slice_spans(numel: int, itemsize: int, max_bytes: int) -> list[tuple[int, int]]:
    """Cut ``numel`` elements of ``itemsize`` bytes into the fewest contiguous ``(start, stop)``
    spans of at most ``max_bytes`` each, of equal size (the last one shorter) and each a multiple
    of 4096 bytes but the last (file offsets stay page-aligned, and equal buffers are reused);
    a span holds at least one page, so it may exceed a ``max_bytes`` under 4096."""
    align = 4096 // itemsize if itemsize and 4096 % itemsize == 0 else 1
    most = max(align, (max_bytes // max(itemsize, 1)) // align * align)
    count = -(-numel // most)
    per = align_up(-(-numel // count), align)   # numel / count, rounded up to a page
    return [(a, min(a + per, numel)) for a in range(0, numel, per)]


@dataclass(frozen=True)
class StateEntry:
    """One state tensor of one parameter, stored at ``offset`` of its sub-group's buffer."""

    param: int          # index of the parameter within its sub-group
    name: str           # the optimizer's state key ("exp_avg", "momentum_buffer" ...)
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class StateLayout:
    """The packed bytes of one sub-group's swapped state: entries in order, ``total`` bytes."""

    entries: tuple[StateEntry, ...]
    total: int


def plan_layout(items: Sequence[tuple[int, str, torch.dtype, tuple[int, ...]]]) -> StateLayout:
    """Pack ``(param, name, dtype, shape)`` items back to back, each at an ``ALIGN`` offset."""
    entries, offset = [], 0
    for param, name, dtype, shape in items:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        entries.append(StateEntry(param, name, dtype, tuple(shape), offset, nbytes))
        offset = _align(offset + nbytes)
    return StateLayout(tuple(entries), offset)


def bound_bytes(numels: Sequence[int], per_element: Sequence[tuple[float, int]]) -> int:
    """Upper bound of a sub-group's packed state: for each parameter of ``numels`` elements,
    one aligned tensor per ``(elements per parameter element, itemsize)`` in ``per_element``."""
    return sum(_align(int(-(-n * ratio // 1)) * itemsize)
               for n in numels for ratio, itemsize in per_element)
