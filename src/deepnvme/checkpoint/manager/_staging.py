"""A snapshot of a rank's share (:mod:`._ranks`, :mod:`._snapshot_share`): its tensors copied
into one reused staging arena, its plain items pickled."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan

from ...memory.copy import ParallelCopy
from .._arena import ArenaPool, Lease, arena_bytes
from ._dcp_step import Staged

__all__ = ["Places", "arena_places", "stage", "stage_tensors"]


def stage(planner: DefaultSavePlanner, plan: SavePlan, pool: ArenaPool) -> tuple[Staged, Lease]:
    """A snapshot of this rank's share: each tensor the plan assigns it (DTensor shards: the
    local shard) copied into one arena leased from ``pool`` (:func:`stage_tensors`), and the
    pickled bytes of its plain items. Release the lease once the share is written."""
    staged: Staged = {}
    tensors: list[tuple[MetadataIndex, torch.Tensor]] = []
    for item in plan.items:
        data = planner.resolve_data(item)
        if isinstance(data, torch.Tensor):
            tensors.append((item.index, data.detach()))
        else:
            staged[item.index] = data
    copies, lease = stage_tensors(tensors, pool)
    staged.update(copies)
    return staged, lease


Places = list[tuple[torch.Tensor, torch.Tensor]]  # per staged tensor: it (own storage) and its arena bytes


def arena_places(arena: torch.Tensor, tensors: list[torch.Tensor]) -> Places:
    """Where each of ``tensors`` is copied in ``arena``, one after the other at page offsets: a
    tensor of its dtype and shape whose storage is exactly its own bytes of the arena
    (``torch.frombuffer``), not the whole arena (DCP's writer clones every tensor whose storage
    is larger than the tensor: for arena views, a second copy of the share), and those bytes."""
    # a memoryview of the arena through a view of it, which holds the arena's storage (freeing
    # the arena swaps the arena tensor's storage out; views stay valid, like the ones before)
    whole = arena[:].numpy().data if tensors else None
    out: Places = []
    offset = 0
    for src in tensors:
        n = src.numel() * src.element_size()
        raw = arena[offset:offset + n]
        own = raw if whole is None or not n else torch.frombuffer(whole[offset:offset + n], dtype=torch.uint8)
        out.append((own.view(src.dtype).view(src.shape), raw))
        offset += arena_bytes([n])
    return out


def stage_tensors(tensors: list[tuple[MetadataIndex, torch.Tensor]], pool: ArenaPool,
                  places: Callable[[torch.Tensor], Places] | None = None) -> tuple[Staged, Lease]:
    """``tensors`` copied into one arena leased from ``pool`` (reused across saves, so a steady
    state of saves allocates nothing and the copies land in memory already faulted in), at
    ``places(arena)`` (default :func:`arena_places`; a caller may keep them from save to save).
    Memory: their bytes, pages rounded up."""
    staged: Staged = {}
    lease = pool.take(arena_bytes(t.numel() * t.element_size() for _, t in tensors))
    try:
        where = places(lease.tensor) if places is not None else arena_places(lease.tensor, [t for _, t in tensors])
        copy = ParallelCopy()
        for (index, src), (dst, raw) in zip(tensors, where):
            if not raw.numel():
                pass
            elif src.device.type == "cpu" and src.is_contiguous() and not src.is_conj() and not src.is_neg():
                copy.add(raw, src.reshape(-1).view(torch.uint8))
            else:
                dst.copy_(src)
            staged[index] = dst
        copy.finish()
    except BaseException:
        lease.release()
        raise
    return staged, lease
