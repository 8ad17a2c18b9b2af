"""Folders placed on a volume: each file whole on one drive, balanced by bytes.

A checkpoint made of several files (safetensors shards, DCP data files) written to a
:class:`~deepnvme.Volume` keeps its own format: every file is a plain file on one drive, so
``safetensors``/``torch.load`` read it where it lies. The folder's index or metadata file lives
in drive 0's folder, beside a placement record (``deepnvme-placement.json``, written durably)
naming the drive of every data file; deepnvme's readers find each file through it.
Readers that want one directory (stock ``dcp.load``, ``from_pretrained``) get it from
:func:`gather_folder` (``deepnvme volume gather``). The drive of a file is chosen by
:func:`assign`: largest file first, to the drive holding the fewest bytes so far.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import CheckpointFormatError, VolumeLayoutError
from ..formats.hf_index import LAYOUTS, CheckpointFiles, Kind, parse_index
from ..formats.index import owners
from ..io import durable
from ..io.volume import Volume, VolumePath

__all__ = ["PLACEMENT_NAME", "drive_folders", "assign", "write_placement", "read_placement",
           "Placement", "gather_folder", "is_placed", "load_placed_folder"]

PLACEMENT_NAME = "deepnvme-placement.json"
_FORMAT = "deepnvme-placement"
_VERSION = 1


def drive_folders(target: object) -> tuple[str, ...] | None:
    """The folder of every drive for a folder on a volume: a :class:`Volume` is its drive
    directories, ``vol / "name"`` the ``name`` folder in each; None for anything else."""
    if isinstance(target, Volume):
        return target.paths
    if isinstance(target, VolumePath):
        return tuple(os.path.join(p, target.name) for p in target.volume.paths)
    return None


def assign(sizes: Mapping[str, int], drives: int, *,
           used: Sequence[int] | None = None) -> dict[str, int]:
    """The drive of each file of ``sizes`` (name -> bytes): largest first (ties by name), each
    to the drive with the fewest bytes so far (ties to the lower index), starting from ``used``
    bytes per drive. Pure."""
    if drives <= 0:
        raise ValueError(f"assign: {drives} drives")
    fill = list(used) if used is not None else [0] * drives
    if len(fill) != drives:
        raise ValueError(f"assign: {len(fill)} fill levels for {drives} drives")
    out: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        drive = min(range(drives), key=lambda d: (fill[d], d))
        out[name] = drive
        fill[drive] += sizes[name]
    return out


class Placement:
    """Where each data file of a placed folder lies: ``files`` maps a file name to its drive
    index into ``folders`` (drive 0's folder holds the record and the index)."""

    def __init__(self, folders: Sequence[str], files: Mapping[str, int]) -> None:
        self.folders = tuple(folders)
        self.files = dict(files)

    def path(self, name: str) -> str:
        """The path of the file ``name``: on its placed drive, else in drive 0's folder."""
        return os.path.join(self.folders[self.files.get(name, 0)], name)

    def check(self, names: Iterable[str]) -> dict[str, str]:
        """The path of each of ``names``; a missing drive folder or file raises
        :class:`VolumeLayoutError` naming the drive, its directory and the file."""
        out = {}
        for name in names:
            drive = self.files.get(name, 0)
            path = os.path.join(self.folders[drive], name)
            if not os.path.isfile(path):
                folder = self.folders[drive]
                why = ("its folder does not exist (drive not mounted?)" if not os.path.isdir(folder)
                       else "the file is missing (removed, or never written there)")
                raise VolumeLayoutError(f"volume drive {drive} ({folder}) should hold {name!r}: "
                                        f"{why}", path=path, errno=errno.ENOENT)
            out[name] = path
        return out


def write_placement(folders: Sequence[str], files: Mapping[str, int], *,
                    named: Sequence[str] | None = None) -> None:
    """Record ``files`` (name -> drive) in drive 0's folder, durably (replacing any record).
    ``named``: the drive folders the record names, when the folder is written under another
    name than it is published as (a checkpoint manager's hidden building folders)."""
    durable.write_json(os.path.join(folders[0], PLACEMENT_NAME),
                       {"format": _FORMAT, "version": _VERSION, "drives": list(named or folders),
                        "files": dict(sorted(files.items()))})


def read_placement(folders: Sequence[str]) -> Placement:
    """The placement record of the folder on these drives (drive 0's folder holds it). A
    missing drive 0 folder or record, a record of another drive count, or a damaged record
    raises :class:`VolumeLayoutError` naming the file."""
    path = os.path.join(folders[0], PLACEMENT_NAME)
    if not os.path.isdir(folders[0]):
        raise VolumeLayoutError(f"volume drive 0 has no folder {folders[0]!r} (drive not "
                                "mounted, or no checkpoint saved there)", path=path,
                                errno=errno.ENOENT)
    try:
        with open(path, encoding="utf-8") as f:
            data: Any = json.load(f)
    except FileNotFoundError:
        raise VolumeLayoutError(f"{folders[0]!r} has no {PLACEMENT_NAME}: it was not saved to a "
                                "volume by deepnvme (open it as a plain folder)", path=path,
                                errno=errno.ENOENT) from None
    except (OSError, ValueError) as exc:
        raise VolumeLayoutError(f"unreadable placement record ({exc})", path=path) from None
    if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("version") != _VERSION:
        raise VolumeLayoutError(f"not a deepnvme placement record of version {_VERSION}", path=path)
    drives, files = data.get("drives"), data.get("files")
    if not isinstance(drives, list) or not isinstance(files, dict) or not all(
            isinstance(v, int) and not isinstance(v, bool) and 0 <= v < len(drives)
            for v in files.values()):
        raise VolumeLayoutError("placement record: 'drives' or 'files' damaged", path=path)
    if len(drives) != len(folders):
        raise VolumeLayoutError(f"the folder was placed on {len(drives)} drives {drives}, the "
                                f"volume was opened with {len(folders)}: {list(folders)}",
                                path=path)
    return Placement(folders, {str(k): v for k, v in files.items()})


def gather_folder(source: Volume | VolumePath, dest: str | os.PathLike[str]) -> list[str]:
    """Copy a folder placed on a volume into the plain folder ``dest`` (created if missing):
    every placed file and drive 0's other files (index, ``.metadata``, config), so readers that
    take one directory (stock ``dcp.load``, ``from_pretrained``) read it. Each file is written
    under a temporary name, fsynced and renamed. Returns the file names copied. Blocks."""
    folders = drive_folders(source)
    if folders is None:
        raise TypeError(f"gather_folder takes a Volume or a volume folder (vol / 'name'), got "
                        f"{type(source).__name__}")
    placement = read_placement(folders)
    names = set(placement.files)
    temps = {os.path.basename(t.path) for t in durable.find_temp_files(folders[0])}
    extra = {n for n in os.listdir(folders[0])
             if n != PLACEMENT_NAME and n not in temps and os.path.isfile(os.path.join(folders[0], n))}
    paths = placement.check(sorted(names | extra))
    out = os.fspath(dest)
    os.makedirs(out, exist_ok=True)
    for name, src in paths.items():
        with durable.atomic_target(os.path.join(out, name)) as tmp:
            shutil.copyfile(src, tmp)
    return sorted(paths)


def is_placed(target: object) -> bool:
    """Whether ``target`` is a volume folder (a Volume or ``vol / "name"``) with a placement
    record, i.e. a folder of whole files placed on the drives rather than a striped file."""
    folders = drive_folders(target)
    return folders is not None and os.path.isfile(os.path.join(folders[0], PLACEMENT_NAME))


def load_placed_folder(target: Volume | VolumePath, kind: Kind,
                       load_file: Callable[[str], Any]) -> dict[str, Any]:
    """Load every file of the ``kind`` checkpoint placed on a volume with ``load_file`` (each
    drive's files by one thread, the drives at once) and merge them under the rule of
    :func:`deepnvme.formats.index.owners`. A missing drive or file raises
    :class:`~deepnvme.VolumeLayoutError` naming it."""
    folders = drive_folders(target)
    if folders is None:
        raise TypeError(f"not a volume folder: {target!r}")
    placement = read_placement(folders)
    files = _find(placement, kind)
    by_drive: dict[int, list[str]] = {}
    for path in files.files:
        by_drive.setdefault(placement.files.get(os.path.basename(path), 0), []).append(path)

    def load_drive(paths: list[str]) -> list[tuple[str, Any]]:
        return [(p, load_file(p)) for p in paths]

    with ThreadPoolExecutor(max(1, len(by_drive)), thread_name_prefix="deepnvme-shards") as pool:
        loaded = [pair for fut in [pool.submit(load_drive, ps) for ps in by_drive.values()]
                  for pair in fut.result()]
    order = {p: i for i, p in enumerate(files.files)}
    loaded.sort(key=lambda pair: order[pair[0]])
    for file, part in loaded:
        if not isinstance(part, dict):
            raise CheckpointFormatError(f"{file!r} holds a {type(part).__name__}, not a dict of tensors")
    owners(loaded, files)
    return {name: value for _, part in loaded for name, value in part.items()}


def _find(placement: Placement, kind: Kind) -> CheckpointFiles:
    """The files of the ``kind`` checkpoint of a placed folder (a single file before an index)."""
    home = placement.folders[0]
    for k, single, index_name in LAYOUTS:
        if k != kind:
            continue
        if single in placement.files or os.path.isfile(os.path.join(home, single)):
            return CheckpointFiles(k, tuple(placement.check([single]).values()))
        index = os.path.join(home, index_name)
        if os.path.isfile(index):
            with open(index, "rb") as f:
                shards = parse_index(f.read(), file=index)
            paths = placement.check(sorted(set(shards.values())))
            weight_map = {name: paths[shard] for name, shard in shards.items()}
            return CheckpointFiles(k, tuple(paths.values()), weight_map, index)
    raise CheckpointFormatError(f"{home!r} (drive 0 of the volume) holds no {kind} checkpoint: "
                                "neither a single file nor an index")
