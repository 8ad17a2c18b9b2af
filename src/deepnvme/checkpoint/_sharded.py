"""Sharded safetensors folders (Hugging Face's layout), in one folder or placed on a volume.

The folder holds ``model-00001-of-0000N.safetensors`` shards and ``model.safetensors.index.json``
(or a single ``model.safetensors``), the files ``from_pretrained`` and ``safetensors`` read. On
a :class:`~deepnvme.Volume` each shard lies whole on one drive (:mod:`._placed`) and the
drives are written and read at the same time, one thread per drive.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..config import IOConfig, parse_size
from ..io import durable
from ..io.volume import Volume, VolumePath
from ._paths import as_path
from ._placed import assign, drive_folders, write_placement
from .safetensors import save_safetensors

__all__ = ["shard_groups", "save_safetensors_sharded"]

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def shard_groups(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[str]]:
    """Tensor names cut into shards in order: a shard takes the next tensor unless that would
    pass ``max_bytes`` (a larger tensor gets a shard of its own), transformers' rule. Pure."""
    groups: list[list[str]] = []
    used = 0
    for name, n in sizes:
        if not groups or (used + n > max_bytes and groups[-1]):
            groups.append([])
            used = 0
        groups[-1].append(name)
        used += n
    return groups


def save_safetensors_sharded(tensors: Mapping[str, torch.Tensor],
                             folder: str | os.PathLike[str] | Volume | VolumePath, *,
                             max_shard_size: int | str = "5GB",
                             metadata: Mapping[str, str] | None = None,
                             config: IOConfig | Mapping[str, Any] | None = None) -> list[str]:
    """Write ``tensors`` as a sharded safetensors folder; returns the paths of the files written.

    Shards of at most ``max_shard_size`` bytes (``int`` or ``"5GB"``; a larger tensor has a
    shard of its own) and ``model.safetensors.index.json``, or one ``model.safetensors``.
    ``folder`` may be a :class:`~deepnvme.Volume` or a folder on one (``vol / "name"``): each
    shard is then written whole to the drive holding the fewest bytes so far, every drive at
    once, and the index lies in drive 0's folder beside ``deepnvme-placement.json``; stock
    ``safetensors`` reads each shard on its drive, :func:`deepnvme.load_safetensors` reads the
    folder through the volume and ``deepnvme volume gather`` copies it into one folder.
    Each file is fsynced and atomically renamed; the index is written last. Shards of an older
    save that the new index does not name are removed. Blocks.
    """
    placed = drive_folders(folder)
    folders = placed or (as_path(folder, "deepnvme.save_safetensors_sharded", "a str or "
                                 "os.PathLike folder path, a Volume or a volume folder"),)
    limit = parse_size(max_shard_size)
    if limit <= 0:
        raise ValueError(f"max_shard_size {max_shard_size!r} must be positive")
    groups = shard_groups([(k, t.nbytes) for k, t in tensors.items()], limit)
    n = len(groups)
    names = [SINGLE] if n <= 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    groups = groups or [[]]
    sizes = {name: sum(tensors[k].nbytes for k in g) for name, g in zip(names, groups)}
    drives = assign(sizes, len(folders))
    for d in set(drives.values()) | {0}:
        os.makedirs(folders[d], exist_ok=True)
    meta = dict(metadata or {})

    def write_drive(d: int) -> None:
        for name, group in zip(names, groups):
            if drives[name] == d:
                save_safetensors({k: tensors[k] for k in group}, os.path.join(folders[d], name),
                                 meta or None, config=config)

    used = sorted(set(drives.values()))
    if len(used) > 1:
        with ThreadPoolExecutor(len(used), thread_name_prefix="deepnvme-shards") as pool:
            for fut in [pool.submit(write_drive, d) for d in used]:
                fut.result()
    else:
        write_drive(used[0])
    if placed is not None:
        write_placement(folders, drives)
    if n > 1:
        index = {"metadata": {"total_size": sum(sizes.values()), **meta},
                 "weight_map": {k: name for name, g in zip(names, groups) for k in g}}
        durable.write_json(os.path.join(folders[0], INDEX), index, indent=2)
    _remove_stale(folders, drives, indexed=n > 1)
    return [os.path.join(folders[drives[name]], name) for name in names]


def _remove_stale(folders: Sequence[str], drives: Mapping[str, int], *, indexed: bool) -> None:
    """Remove shards, a single file or an index of an older save that this one replaced."""
    keep = set(drives.items()) | ({(INDEX, 0)} if indexed else set())
    for d, folder in enumerate(folders):
        if not os.path.isdir(folder):
            continue
        for name in os.listdir(folder):
            if (_SHARD_RE.match(name) or name in (SINGLE, INDEX)) and (name, d) not in keep:
                durable.remove_quietly(os.path.join(folder, name))
