"""``load_into``'s mapped path: CPU targets copied from a private mapping of each file.

The device's readahead fills the page cache (see :mod:`._load_path` for when that beats the
engine); each window of :data:`WINDOW` bytes is populated by parallel ``MADV_POPULATE_READ``
while the previous one is copied into its targets by ``Tensor.copy_`` (dtype conversion and
strided targets included, so no bounce buffers), then unmapped again. Memory: at most two
windows of page-cache pages mapped at once (``2 x max(WINDOW, largest tensor)``), nothing
allocated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from ..io.mapped import check_span, map_private, populate, release
from ._fill_plan import Fill

__all__ = ["WINDOW", "windows", "fill_mapped"]

WINDOW = 32 << 20
"""Bytes populated per step (a larger tensor is a window of its own)."""


def windows(fills: Sequence[Fill], window: int = WINDOW) -> list[list[Fill]]:
    """``fills`` of one file in file order, cut into runs of at most ``window`` bytes (a larger
    tensor is a run of its own). Pure."""
    out: list[list[Fill]] = []
    size = 0
    for fill in sorted(fills, key=lambda f: f.source.offset):
        if not out or size + fill.source.nbytes > window:
            out.append([])
            size = 0
        out[-1].append(fill)
        size += fill.source.nbytes
    return out


def _span(group: Sequence[Fill]) -> tuple[int, int]:
    start = min(f.source.offset for f in group) & ~4095  # madvise takes page-aligned addresses
    return start, max(f.source.offset + f.source.nbytes for f in group)


def fill_mapped(fills: Sequence[Fill], tensors: Mapping[str, torch.Tensor], *, threads: int) -> None:
    """Copy every fill (CPU targets, non-empty sources) from its file's mapping. Blocks; a
    read error raises :class:`DeepNVMeIOError` naming the file and offset, with the targets
    partly filled."""
    by_file: dict[str, list[Fill]] = {}
    for fill in fills:
        by_file.setdefault(fill.source.file, []).append(fill)
    with ThreadPoolExecutor(1, thread_name_prefix="deepnvme-map-ahead") as ahead:
        for file, group in by_file.items():
            mapping = map_private(file)
            for fill in group:
                check_span(mapping, path=file, offset=fill.source.offset, size=fill.source.nbytes)
            steps = windows(group)

            def read(i: int, file: str = file, mapping: torch.UntypedStorage = mapping,
                     steps: list[list[Fill]] = steps) -> None:
                lo, hi = _span(steps[i])
                per_thread = -(-(hi - lo) // threads)
                populate(mapping[lo:hi], path=file, threads=threads, offset=lo,
                         chunk=max(1 << 20, -(-per_thread // 4096) * 4096))

            pending: Future[None] = ahead.submit(read, 0)
            for i, step in enumerate(steps):
                pending.result()  # the read error of this window, naming file and offset
                if i + 1 < len(steps):
                    pending = ahead.submit(read, i + 1)
                try:
                    _copy(mapping, step, tensors)
                finally:
                    lo, hi = _span(step)
                    release(mapping[lo:hi])


def _copy(mapping: torch.UntypedStorage, step: Sequence[Fill], tensors: Mapping[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for fill in step:
            src = fill.source
            raw = torch.empty(0, dtype=torch.uint8).set_(mapping[src.offset:src.offset + src.nbytes]).view(src.dtype)
            view = raw.as_strided(src.shape, src.stride) if src.stride is not None else raw.view(src.shape)
            tensors[fill.name].copy_(view)
