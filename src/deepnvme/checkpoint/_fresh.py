"""Stored tensors read into new CPU memory by one of the two load paths (:mod:`._load_path`).

Tensors of one file are read as one region spanning them (one large request rather than one
per tensor, and no unaligned edges between tensors): ``direct`` reads the region with the
engine into one new allocation aligned to the region's file offset; ``mapped`` populates that
range of a private mapping of the file. Either way the tensors are views of the region, so
they share its storage (like ``safetensors.torch.load_file``'s tensors): a region stays
allocated while any of its tensors lives. Where the wanted tensors leave more than
:data:`MAX_GAP_FRACTION` of their span unread, each tensor gets its own allocation instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, wait

import torch

from ..config import IOConfig
from ..formats.safetensors import StoredTensor
from ..handles.aio import AioHandle, wait_all
from ..io.mapped import check_span, map_private, populate
from ..memory.views import aligned_empty, storage_bytes
from ._load_path import Path

__all__ = ["MAX_GAP_FRACTION", "read_fresh", "regions"]

MAX_GAP_FRACTION = 0.125
"""A file's wanted tensors are read as one region unless bytes between them exceed this share
of the span (then one allocation per tensor: unread gaps would cost memory)."""


Region = tuple[str, int, int, list[tuple[str, StoredTensor]]]


def regions(sources: Mapping[str, StoredTensor]) -> list[Region]:
    """``(file, start, end, [(name, tensor), ...])`` per read: per file one span of all its
    non-empty tensors, or one per tensor where the span is mostly gaps. Pure."""
    by_file: dict[str, list[tuple[str, StoredTensor]]] = {}
    for name, s in sources.items():
        if s.nbytes:
            by_file.setdefault(s.file, []).append((name, s))
    out: list[Region] = []
    for file, items in by_file.items():
        items.sort(key=lambda item: item[1].offset)
        start, end = items[0][1].offset, max(s.offset + s.nbytes for _, s in items)
        if (end - start) - sum(s.nbytes for _, s in items) > MAX_GAP_FRACTION * (end - start):
            out.extend((file, s.offset, s.offset + s.nbytes, [(n, s)]) for n, s in items)
        else:
            out.append((file, start, end, items))
    return out


def _view(region: torch.Tensor, start: int, s: StoredTensor) -> torch.Tensor:
    """Tensor ``s`` over its bytes of ``region`` (a storage of its own sharing the region's
    memory, so any file offset can hold any dtype)."""
    lo = region.storage_offset() + s.offset - start
    raw = storage_bytes(region.untyped_storage()[lo:lo + s.nbytes]).view(s.dtype)
    return raw.as_strided(s.shape, s.stride) if s.stride is not None else raw.view(s.shape)


def read_fresh(sources: Mapping[str, StoredTensor], path: Path, cfg: IOConfig) -> dict[str, torch.Tensor]:
    """New CPU tensors holding ``sources`` (name -> where it is stored), read by ``path``.

    Blocks until every byte is in; a failed or short read raises :class:`DeepNVMeIOError`
    naming the file and offset, and no tensor is returned. Memory: the regions of
    :func:`regions` (about the tensors' bytes); with ``mapped``, page-cache pages mapped
    copy-on-write (a file truncated or rewritten in place afterwards changes or faults them).
    """
    out = {name: torch.empty(s.shape, dtype=s.dtype) for name, s in sources.items() if not s.nbytes}
    plan = regions(sources)
    views: dict[str, tuple[torch.Tensor, int, StoredTensor]] = {}
    if path == "mapped":
        maps: dict[str, torch.UntypedStorage] = {}
        for file, start, end, items in plan:
            mapping = maps.get(file)
            if mapping is None:
                mapping = maps[file] = map_private(file)
            check_span(mapping, path=file, offset=start, size=end - start)
            lo = start & ~4095  # madvise takes page-aligned addresses
            populate(mapping[lo:end], path=file, threads=cfg.intra_op_parallelism, offset=lo)
            region = storage_bytes(mapping[start:end])
            views.update((name, (region, start, s)) for name, s in items)
    else:
        futures: list[Future[int]] = []
        with AioHandle(config=cfg) as handle:
            try:
                for file, start, end, items in plan:
                    region = aligned_empty(end - start, start)
                    futures.append(handle.submit_read(region, file, offset=start))
                    views.update((name, (region, start, s)) for name, s in items)
            except BaseException:
                wait(futures)  # no read may target a region after this; the first error wins
                raise
            wait_all(futures)  # every completion checked
    for name, (region, start, s) in views.items():
        out[name] = _view(region, start, s)
    return {name: out[name] for name in sources}
