"""Reading a manager checkpoint back with its manifest checked: file size, tensors, checksums.

The pickled object is parsed first without its data (``meta`` tensors), so a damaged
``data.pkl`` is reported as a corrupt checkpoint naming the step before any data is read.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...config import IOConfig
from ...errors import CheckpointCorruptError, CheckpointFormatError, VolumeLayoutError
from ...formats.torchsave import torch_skeleton
from ...formats.torchzip import RecordSpan
from .._placed import PLACEMENT_NAME, read_placement
from ..loader import load as load_file
from ._checksums import checksum, file_checksum, hasher, named_storages
from ._steps import FILE, MANIFEST, find_step_dirs, is_dcp_step, read_manifest

__all__ = ["load_checked", "open_checked", "state_file", "checked_skeleton", "check_tensors", "check_structure",
           "check_sums", "CheckResult", "find_targets", "check_one", "check_step_files"]


def state_file(path: str, manifest: Mapping[str, Any], what: str, drives: Sequence[str] | None = None) -> str:
    """Where the state file of the checkpoint directory ``path`` lies: beside its manifest, or,
    for a step of a manager on a volume (``"drive"`` in the manifest), in the same-named folder
    of its drive among ``drives`` (the manager's drive folders; None: those the manifest names)."""
    if "drive" not in manifest:
        return os.path.join(path, FILE)
    folders, drive = manifest.get("drives") if drives is None else list(drives), manifest["drive"]
    if (not isinstance(folders, list) or isinstance(drive, bool) or not isinstance(drive, int)
            or not 0 <= drive < len(folders)):
        raise CheckpointCorruptError(f"checkpoint {what}: its manifest names drive {drive!r} of "
                                     f"{folders!r}, which is not one of the volume's drives")
    return os.path.join(str(folders[drive]), os.path.basename(os.path.normpath(path)), FILE)


def open_checked(path: str, step: int | None, *, drives: Sequence[str] | None = None
                 ) -> tuple[dict[str, Any], str, str]:
    """The manifest of checkpoint directory ``path``, the step's words for errors, and its
    state file (:func:`state_file`), whose size is checked against the manifest
    (:class:`CheckpointCorruptError`, naming the drive's path for a step on a volume)."""
    manifest = read_manifest(path, step)
    what = f"step {manifest.get('step', step)}"
    file = state_file(path, manifest, what, drives)
    try:
        size = os.path.getsize(file)
    except FileNotFoundError:
        where = "" if "drive" not in manifest else f" (volume drive {manifest['drive']}: " + (
            "its folder does not exist, drive not mounted?)" if not os.path.isdir(os.path.dirname(
                os.path.dirname(file))) else "the file was removed)")
        raise CheckpointCorruptError(f"checkpoint {what} is incomplete: {file!r} is missing{where}") from None
    if size != manifest["file_size"]:
        raise CheckpointCorruptError(f"checkpoint {what}: {file!r} is {size} bytes; the manifest "
                                     f"says {manifest['file_size']}")
    return manifest, what, file


def checked_skeleton(file: str, manifest: Mapping[str, Any], what: str
                     ) -> tuple[Any, dict[int, str], dict[str, RecordSpan]]:
    """The state file's object with ``meta`` tensors (see :func:`torch_skeleton`), its names and
    sizes checked against the manifest; an unreadable archive or pickle (damaged bytes) or a
    mismatch is a :class:`CheckpointCorruptError` naming the step. Reads no tensor data."""
    try:
        obj, keys, spans = torch_skeleton(file)
    except CheckpointFormatError as exc:
        raise CheckpointCorruptError(f"checkpoint {what}: {exc}") from exc
    check_structure(obj, manifest, what)
    return obj, keys, spans


def load_checked(path: str, step: int | None, *, map_location: Any = None,
                 config: IOConfig | Mapping[str, Any] | None = None,
                 drives: Sequence[str] | None = None) -> tuple[Any, dict[str, Any]]:
    """Load the checkpoint directory ``path`` and check it against its manifest; return
    ``(object, manifest)``. Any mismatch is a :class:`CheckpointCorruptError` naming the step
    and the file or tensor. ``drives``: as for :func:`state_file`. Blocks; memory: the loaded
    checkpoint."""
    manifest, what, file = open_checked(path, step, drives=drives)
    checked_skeleton(file, manifest, what)   # damaged data.pkl: corrupt, before reading the data
    try:
        obj = load_file(file, map_location, config=config)
    except (CheckpointFormatError, pickle.UnpicklingError) as exc:
        raise CheckpointCorruptError(f"checkpoint {what}: {exc}") from exc
    check_tensors(obj, manifest, what)
    return obj, manifest


def check_tensors(obj: Any, manifest: Mapping[str, Any], what: str) -> None:
    """Compare the loaded object's storages with the manifest's names, sizes and checksums."""
    check_sums(check_structure(obj, manifest, what), manifest, what)


def check_structure(obj: Any, manifest: Mapping[str, Any], what: str) -> dict[str, torch.UntypedStorage]:
    """Compare ``obj``'s storages (real or ``meta``) with the manifest's names and sizes; return
    them by manifest name."""
    want: dict[str, dict[str, Any]] = manifest["tensors"]
    have = dict(named_storages(obj))
    missing = [n for n in want if n not in have]
    extra = [n for n in have if n not in want]
    if missing or extra:
        raise CheckpointCorruptError(f"checkpoint {what}: tensors do not match the manifest "
                                     f"(missing {missing[:5]}, unexpected {extra[:5]})")
    for name, entry in want.items():
        if have[name].nbytes() != entry["nbytes"]:
            raise CheckpointCorruptError(f"checkpoint {what}: tensor {name!r} has {have[name].nbytes()} "
                                         f"bytes; the manifest says {entry['nbytes']}")
    return have


def check_sums(data: Mapping[str, torch.UntypedStorage | torch.Tensor], manifest: Mapping[str, Any],
               what: str, *, partial: bool = False) -> None:
    """Compare each manifest tensor's bytes in ``data`` (a storage, or a uint8 CPU tensor) with
    its stored checksum; nothing to do when the manifest has none. ``partial``: ``data`` holds
    some of the tensors (a partial restore); only those are checked."""
    algorithm = manifest.get("checksum")
    if not algorithm:
        return
    fn = hasher(algorithm)
    for name, entry in manifest["tensors"].items():
        if partial and name not in data:
            continue
        if checksum(fn, data[name]) != entry["checksum"]:
            raise CheckpointCorruptError(f"checkpoint {what}: tensor {name!r} fails its {algorithm} "
                                         "checksum (its bytes changed after the save)")


@dataclass(frozen=True)
class CheckResult:
    """The verdict on one checkpoint: ``problem`` is None when intact."""

    path: str
    step: int | None
    problem: str | None
    checksum: str | None  # the algorithm whose sums were checked; None: they were absent
    tensors: int
    files: int | None = None  # a step saved by several ranks: its data files (tensors: not counted)


def find_targets(path: str) -> list[tuple[str, int | None]]:
    """The checkpoints at ``path``: itself if it is one checkpoint directory, else every ``step-N``
    directory of the manager directory ``path``, committed or not, so that one missing its
    manifest is reported as incomplete (step None: read from the manifest). Empty: none."""
    if os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(os.path.join(path, FILE)):
        return [(path, None)]
    return [(where, s) for s, where in find_step_dirs(path)]


def check_one(path: str, step: int | None, *,
              config: IOConfig | Mapping[str, Any] | None = None) -> CheckResult:
    """Read the checkpoint directory ``path`` whole and check it (sizes, tensors, checksums)."""
    if is_dcp_step(path):
        return _check_ranks_step(path, step)
    try:
        _, manifest = load_checked(path, step, config=config)
    except CheckpointCorruptError as exc:
        return CheckResult(path=path, step=step, problem=str(exc), checksum=None, tensors=0)
    return CheckResult(path=path, step=int(manifest["step"]), problem=None,
                       checksum=manifest.get("checksum"), tensors=len(manifest["tensors"]))


def check_step_files(path: str, manifest: Mapping[str, Any], names: list[str] | None = None, *,
                     drives: Sequence[str] | None = None) -> list[str]:
    """What is wrong with the files of the multi-rank step at ``path`` (``names``: these of the
    manifest's files; None: all): missing, of another size than the manifest says, or failing
    their stored per-file checksum (when the step has them). Empty: intact. Reads each file.
    ``drives``: the step's folder on every drive of a volume (``path`` is drive 0's): each data
    file is looked for on the drive its placement record names."""
    sizes: dict[str, int] = manifest.get("files", {})
    sums: dict[str, int] = manifest.get("file_checksums") or {}
    algorithm = manifest.get("checksum")
    wrong = []
    try:
        placement = None if drives is None else read_placement(drives)
    except VolumeLayoutError as exc:
        return [str(exc)]
    for name in sizes if names is None else names:
        full = os.path.join(path, name) if placement is None else placement.path(name)
        shown = repr(name) if placement is None else f"{full!r} (volume drive {placement.files.get(name, 0)})"
        have = os.path.getsize(full) if os.path.isfile(full) else None
        if have != sizes[name]:
            wrong.append(f"{shown} is {'missing' if have is None else f'{have} bytes'}, the manifest "
                         f"says {sizes[name]}")
        elif algorithm and name in sums and file_checksum(algorithm, full) != sums[name]:
            wrong.append(f"{shown} fails its {algorithm} checksum (its bytes changed after the save)")
    return wrong


def _recorded_drives(path: str) -> list[str] | None:
    """The drive folders a multi-rank step on a volume names in its placement record (``path``
    is drive 0's folder; None: no record, a plain folder). A damaged record: ``[path]``, which
    :func:`check_step_files` reports."""
    try:
        with open(os.path.join(path, PLACEMENT_NAME), encoding="utf-8") as f:
            drives = json.load(f).get("drives")
    except FileNotFoundError:
        return None
    except (OSError, ValueError, AttributeError):
        return [path]
    if not isinstance(drives, list) or not drives or not all(isinstance(d, str) for d in drives):
        return [path]
    return [path, *drives[1:]]  # drive 0's folder is where the record was found


def _node_files(path: str, manifest: Mapping[str, Any], drives: Sequence[str] | None = None) -> list[str] | None:
    """The files the step directory ``path`` of one node should hold when the step was saved on
    several nodes (its manifest names them): ``.metadata`` and the files of the node's ranks,
    for the node whose files are here (``drives``: on a volume, in the step's folder on every
    drive). None for a step in one directory or one holding every file (the durable tier): all
    its files."""
    nodes = manifest.get("nodes") or []
    here = {n for d in drives or [path] if os.path.isdir(d) for n in os.listdir(d)}
    if len(nodes) < 2 or set(manifest.get("files", {})) <= here:  # one node, or a durable copy: all
        return None
    ranks = manifest["ranks"]
    node = max(nodes, key=lambda n: sum(f in here for r in n for f in ranks[r]["files"]))
    return sorted({f for r in node for f in ranks[r]["files"]} | {".metadata"})


def _check_ranks_step(path: str, step: int | None) -> CheckResult:
    """A step saved by several ranks (a DCP checkpoint): every file the manifest names is there
    with its size and, when stored, its per-file checksum (on one node of several: that node's
    files; on a volume, each on the drive its placement record names)."""
    try:
        manifest = read_manifest(path, step)
        drives = _recorded_drives(path)
        if wrong := check_step_files(path, manifest, _node_files(path, manifest, drives), drives=drives):
            raise CheckpointCorruptError(f"checkpoint step {manifest.get('step', step)}: {'; '.join(wrong)}")
    except CheckpointCorruptError as exc:
        return CheckResult(path=path, step=step, problem=str(exc), checksum=None, tensors=0)
    return CheckResult(path=path, step=int(manifest["step"]), problem=None, checksum=manifest.get("checksum"),
                       tensors=0, files=len(manifest.get("files", {})))
