"""FastPersist's data-parallel write: several ranks fill one torch.save-compatible file together.

Every rank of the group holds the same object (data-parallel replicas). Rank 0 lets PyTorch
write the zip skeleton to a temporary file and broadcasts its name and storage offsets; every
rank then writes its own contiguous share of the storage bytes (the same deterministic plan on
all ranks, cut at 4096-byte boundaries) with O_DIRECT and fsyncs; after an all-gather confirms
that every rank succeeded, rank 0 renames the file into place and fsyncs the directory. If any
rank fails, the temporary file is removed and every rank raises. The directory must be on a
filesystem all ranks of the group can write (one host, or a shared parallel filesystem).

"Distributed" here means the writing, not the format: the result is one plain torch.save file,
not torch.distributed.checkpoint's sharded folder (that is :mod:`deepnvme.checkpoint.dcp`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ..config import IOConfig, checkpoint_config
from ..errors import DistributedSaveError
from ..formats.torchzip import RecordSpan, check_sizes, split_byte_ranges
from ..handles.aio import AioHandle
from ..io import durable
from ..io.file import reserve
from ..memory.views import storage_bytes
from ._paths import as_path
from .saver import StorageLayout, pickle_skeleton, write_skeleton

__all__ = ["save_distributed", "DistributedSaveError"]


def save_distributed(obj: Any, path: str | os.PathLike[str], *, group: Any = None,
                     config: IOConfig | Mapping[str, Any] | None = None) -> None:
    """Save ``obj`` (identical on every rank of ``group``) to one ``torch.save`` file at ``path``.

    Collective: every rank of ``group`` (default: the world) must call it with the same path.
    Each rank writes about ``1 / world_size`` of the storage bytes. Blocks until the file is
    durable under its final name on all ranks. Loads with plain ``torch.load``.
    """
    path = durable.resolve_target(as_path(path, "deepnvme.save_distributed"))
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    src = dist.get_global_rank(group, 0) if group is not None else 0
    cfg = checkpoint_config(config)
    error: BaseException | None = None
    header: list[Any] = [None]
    if rank == 0:
        tmp = durable.temp_name(path)
        try:
            durable.check_target_dir(path)
            layout = write_skeleton(obj, tmp)
            reserve(tmp, os.path.getsize(tmp))
            header[0] = (tmp, {k: span for k, (_, span) in layout.items.items()})
        except BaseException as exc:  # reported to every rank below
            durable.remove_quietly(tmp)
            error = exc
            header[0] = ("", repr(exc))
    dist.broadcast_object_list(header, src=src, group=group)
    tmp, spans = header[0]
    if not tmp:
        raise DistributedSaveError(f"rank 0 could not start the save of {path!r}: {spans}") from error
    try:
        if rank != 0:
            storages = pickle_skeleton(obj, os.devnull)
            check_sizes(spans, {k: s.nbytes() for k, s in storages.items()}, path=path)
            layout = StorageLayout({k: (storages[k], spans[k]) for k in spans})
        _write_share(layout, spans, rank, world, tmp, cfg)
    except BaseException as exc:  # every rank must reach the all-gather
        error = exc
    # object collectives pick the right device for the group's backend (CPU tensors fail on NCCL)
    flags: list[Any] = [None] * world
    dist.all_gather_object(flags, error is None, group=group)
    ok = all(flags)
    if ok and rank == 0:
        try:
            durable.commit(tmp, path, fsync_file=True)
        except BaseException as exc:
            durable.remove_quietly(tmp)
            error = exc
    elif not ok and rank == 0:
        durable.remove_quietly(tmp)
    done = [ok and not (rank == 0 and error is not None)]
    dist.broadcast_object_list(done, src=src, group=group)
    if not done[0]:
        where = f"this rank ({rank}): {error!r}" if error is not None else "another rank"
        raise DistributedSaveError(f"data-parallel save of {path!r} failed on {where}; the "
                                   "previous file (if any) is untouched") from error


def _write_share(layout: StorageLayout, spans: dict[str, RecordSpan], rank: int, world: int,
                 tmp: str, cfg: IOConfig) -> None:
    pieces = split_byte_ranges(spans, world)[rank]
    items = []
    for piece in pieces:
        storage, _ = layout.items[piece.key]
        data = storage_bytes(storage)[piece.start:piece.start + piece.length]
        items.append((data, piece.file_offset))
    with AioHandle(config=cfg) as handle:
        handle.write_many(tmp, items, fsync=True).result()
