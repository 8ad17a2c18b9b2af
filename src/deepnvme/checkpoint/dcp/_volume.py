"""DCP checkpoints placed on a volume: every data file whole on one drive, balanced by bytes.

The coordinator sizes every rank's data files from the save plans (the same buckets
``FileSystemWriter.write_data`` makes), assigns each file a drive (:func:`..._placed.assign`)
and hands each rank its drives in its plan's storage data; ``.metadata`` and the placement
record lie in drive 0's folder. Stock ``dcp.load`` needs one directory: each ``.distcp`` file
is still a plain DCP data file, and :func:`deepnvme.gather_folder` joins them.
"""

from __future__ import annotations

import dataclasses
import os
import queue
from collections.abc import Sequence

from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    _item_size,
    _split_by_size_and_type,
    _StoragePrefix,
)
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType

from ...io import durable
from ...io.volume import Volume, VolumePath
from .._placed import assign, drive_folders

__all__ = ["PlacedPrefix", "place_plans", "file_queue", "volume_home", "remove_unnamed"]


def volume_home(path: str | os.PathLike[str] | Volume | VolumePath
                ) -> tuple[tuple[str, ...] | None, str | os.PathLike[str]]:
    """The drive folders of a volume folder (None for a plain path) and the folder that holds
    ``.metadata``: drive 0's, or the plain path itself."""
    if isinstance(path, (Volume, VolumePath)):
        folders = drive_folders(path) or ()
        return folders, folders[0]
    return None, path


def remove_unnamed(directories: Sequence[str], named: set[str]) -> None:
    """Delete the ``__*.distcp`` data files in ``directories`` that are not in ``named``."""
    for directory in directories:
        for name in os.listdir(directory) if os.path.isdir(directory) else ():
            if name.startswith("__") and name.endswith(DEFAULT_SUFFIX) and name not in named:
                durable.remove_quietly(os.path.join(directory, name))


@dataclasses.dataclass
class PlacedPrefix(_StoragePrefix):
    """A rank's file name prefix and the drive index of each of its data files, in order."""

    drives: tuple[int, ...] = ()


def _buckets(items: list[WriteItem], thread_count: int, single_file_per_rank: bool
             ) -> list[list[WriteItem]]:
    """The items of each data file a rank writes, as ``FileSystemWriter.write_data`` cuts them."""
    if single_file_per_rank:
        return _split_by_size_and_type(thread_count, items)
    return [[item] for item in items]


def _bytes(items: list[WriteItem]) -> int:
    return sum(_item_size(i) for i in items if i.type != WriteItemType.BYTE_IO)


def place_plans(plans: list[SavePlan], drives: int, *, thread_count: int,
                single_file_per_rank: bool) -> tuple[list[SavePlan], dict[str, int]]:
    """Give every rank's data files a drive; returns the plans (their storage data a
    :class:`PlacedPrefix`) and file name -> drive. Each plan's storage data must already be
    a ``_StoragePrefix``."""
    sizes: dict[str, int] = {}
    names: list[list[str]] = []
    for plan in plans:
        prefix = plan.storage_data.prefix
        ours = []
        for k, bucket in enumerate(_buckets(plan.items, thread_count, single_file_per_rank)):
            name = f"{prefix}{k}{DEFAULT_SUFFIX}"
            sizes[name] = _bytes(bucket)
            ours.append(name)
        names.append(ours)
    where = assign(sizes, drives)
    out = [dataclasses.replace(plan, storage_data=PlacedPrefix(
        plan.storage_data.prefix, tuple(where[n] for n in ours)))
        for plan, ours in zip(plans, names)]
    return out, where


def file_queue(plan: SavePlan, folders: Sequence[str], *, thread_count: int,
               single_file_per_rank: bool) -> queue.Queue[tuple[str, str, list[WriteItem]]]:
    """``FileSystemWriter``'s queue of (path, file name, items), each path on its drive."""
    storage: PlacedPrefix = plan.storage_data
    buckets = _buckets(plan.items, thread_count, single_file_per_rank)
    if len(buckets) != len(storage.drives):
        raise RuntimeError(f"DCP volume save: this rank cut {len(buckets)} data files, the "
                           f"coordinator placed {len(storage.drives)} (writers configured "
                           "differently on different ranks?)")
    out: queue.Queue[tuple[str, str, list[WriteItem]]] = queue.Queue()
    for k, (bucket, drive) in enumerate(zip(buckets, storage.drives)):
        name = f"{storage.prefix}{k}{DEFAULT_SUFFIX}"
        os.makedirs(folders[drive], exist_ok=True)
        out.put((os.path.join(folders[drive], name), name, bucket))
    return out
