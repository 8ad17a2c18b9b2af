"""Hugging Face checkpoint folders as rules: which files hold the weights, and the shard index.

A folder holds ``model.safetensors``, shards listed by ``model.safetensors.index.json``,
``pytorch_model.bin`` or shards listed by ``pytorch_model.bin.index.json``. An index is
``{"metadata": {...}, "weight_map": {tensor name: shard file name}}``; shard names must be plain
file names in the folder, and only the files an index names are read. Nothing here reads
tensor data: :func:`find_checkpoint` lists the folder and reads at most the index.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Literal

from ..errors import CheckpointFormatError
from .safetensors import MAX_HEADER
from .torchzip import ZIP_MAGIC

__all__ = ["Kind", "LAYOUTS", "CheckpointFiles", "file_kind", "sniff", "sniff_file", "parse_index", "find_checkpoint",
           "check_weight_map", "MAX_INDEX"]

Kind = Literal["safetensors", "torch"]

LAYOUTS: tuple[tuple[Kind, str, str], ...] = (
    ("safetensors", "model.safetensors", "model.safetensors.index.json"),
    ("torch", "pytorch_model.bin", "pytorch_model.bin.index.json"),
)
"""(kind, single-file name, index name) in the order a folder is searched."""

MAX_INDEX = 100_000_000
"""Largest index file (bytes) accepted; a real one is a few hundred KiB."""


@dataclasses.dataclass(frozen=True)
class CheckpointFiles:
    """The files of one checkpoint: their ``kind``, paths in read order, and the index's
    ``weight_map`` (tensor name -> shard path) when the checkpoint is sharded."""

    kind: Kind
    files: tuple[str, ...]
    weight_map: Mapping[str, str] | None = None
    index: str | None = None


def sniff(head: bytes, size: int) -> Kind | None:
    """A file's format from its first 9 (or more) bytes and its size, or None.

    safetensors: an 8-byte little-endian header length that fits the file, then ``{``;
    torch.save: a zip archive (``PK\\x03\\x04``)."""
    if head.startswith(ZIP_MAGIC):
        return "torch"
    if len(head) >= 9 and head[8:9] == b"{":
        (n,) = struct.unpack("<Q", head[:8])
        if 2 <= n <= min(MAX_HEADER, size - 8):
            return "safetensors"
    return None


def sniff_file(path: str | os.PathLike[str]) -> Kind | None:
    """:func:`sniff` on the file at ``path``; None if it is neither format or cannot be read."""
    try:
        with open(path, "rb") as f:
            return sniff(f.read(9), os.fstat(f.fileno()).st_size)
    except OSError:
        return None


def file_kind(path: str) -> Kind:
    """A single file's format from its name: ``*.safetensors`` or else a torch.save file."""
    return "safetensors" if path.endswith(".safetensors") else "torch"


def _plain_name(name: object) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name and os.path.basename(name) == name)


def parse_index(raw: bytes, *, file: str) -> dict[str, str]:
    """The ``weight_map`` of an index file's bytes ``raw``; any fault is a
    :class:`CheckpointFormatError` naming ``file`` and the field."""
    try:
        index = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointFormatError(f"{file!r}: the index is not UTF-8 ({exc})") from None
    except (ValueError, RecursionError) as exc:
        raise CheckpointFormatError(f"{file!r}: the index is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(index, dict):
        raise CheckpointFormatError(f"{file!r}: the index must be a JSON object, got {type(index).__name__}")
    metadata = index.get("metadata", {})
    if metadata is not None and not isinstance(metadata, dict):
        raise CheckpointFormatError(f"{file!r}: field 'metadata' must be an object, got "
                                    f"{str(metadata)[:100]}")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointFormatError(f"{file!r}: field 'weight_map' must be an object mapping tensor "
                                    f"names to shard file names, got {str(weight_map)[:100]}")
    if not weight_map:
        raise CheckpointFormatError(f"{file!r}: field 'weight_map' is empty")
    for name, shard in weight_map.items():
        if not _plain_name(shard):
            raise CheckpointFormatError(f"{file!r}: weight_map[{name!r}] = {str(shard)[:100]!r} is not a "
                                        "plain file name in the checkpoint's folder")
    return dict(weight_map)


def _read_index(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read(MAX_INDEX + 1)
    if len(raw) > MAX_INDEX:
        raise CheckpointFormatError(f"{path!r}: index larger than {MAX_INDEX} bytes")
    return raw


def find_checkpoint(path: str, kinds: Sequence[Kind] = ("safetensors", "torch"), *,
                    any_safetensors: bool = False) -> CheckpointFiles:
    """The checkpoint at ``path``: a file (its kind from its name), or a folder searched in
    :data:`LAYOUTS` order for the given ``kinds`` (a single file before an index).
    ``any_safetensors``: a folder with neither then gives every ``*.safetensors`` file in it, as
    vLLM's default loader takes them (``consolidated.safetensors``, shards without an index)."""
    if not os.path.isdir(path):
        if not os.path.exists(path):
            raise FileNotFoundError(2, "no such checkpoint file or folder", path)
        return CheckpointFiles(file_kind(path), (path,))
    for kind, single, index_name in LAYOUTS:
        if kind not in kinds:
            continue
        one = os.path.join(path, single)
        if os.path.isfile(one):
            return CheckpointFiles(kind, (one,))
        index = os.path.join(path, index_name)
        if os.path.isfile(index):
            weight_map = {name: os.path.join(path, shard)
                          for name, shard in parse_index(_read_index(index), file=index).items()}
            files = tuple(sorted(set(weight_map.values())))
            for shard in files:
                if not os.path.isfile(shard):
                    raise CheckpointFormatError(f"{index!r} names shard {os.path.basename(shard)!r}, "
                                                "which is not in the folder")
            return CheckpointFiles(kind, files, weight_map, index)
    if any_safetensors and "safetensors" in kinds:
        loose = sorted(os.path.join(path, n) for n in os.listdir(path)
                       if n.endswith(".safetensors") and os.path.isfile(os.path.join(path, n)))
        if loose:
            return CheckpointFiles("safetensors", tuple(loose))
    wanted = [name for kind, single, index in LAYOUTS if kind in kinds for name in (index, single)]
    if any_safetensors and "safetensors" in kinds:
        wanted.append("any *.safetensors file")
    raise CheckpointFormatError(f"{path!r} holds no checkpoint: it holds none of {', '.join(wanted)}")


def check_weight_map(files: CheckpointFiles, found: Mapping[str, str]) -> None:
    """Every tensor the index names must be in the shard it names; ``found`` maps each tensor
    name read from the shards to its file. Tensors the index does not name are allowed."""
    if files.weight_map is None:
        return
    for name, shard in files.weight_map.items():
        where = found.get(name)
        if where != shard:
            seen = f"it is in {where!r}" if where is not None else "no shard holds it"
            raise CheckpointFormatError(f"{files.index!r}: weight_map puts {name!r} in {shard!r}, "
                                        f"but {seen}")
