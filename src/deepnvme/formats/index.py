"""The one tensor index of a checkpoint: each tensor's file, byte range, dtype and shape.

A checkpoint is a file or a folder, whose files :func:`~.hf_index.find_checkpoint` chooses (one
file, an index's shards, or every ``*.safetensors`` file). Each file is read by its format's own
parser, :mod:`.safetensors` (the header) or :mod:`.torchsave` (``data.pkl``); no tensor data is
read. One rule for every reader, :func:`owners`: a tensor name found in two files, or a tensor
that is not in the file the index's ``weight_map`` names for it, is a
:class:`CheckpointFormatError` naming the tensor and both files. Tensors the ``weight_map`` does
not name are kept (an index may be incomplete; the files are the truth).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Iterable, Mapping, Sequence

from ..errors import CheckpointFormatError
from .hf_index import CheckpointFiles, Kind, check_weight_map, find_checkpoint, sniff_file
from .safetensors import StoredTensor, locate, read_header
from .torchsave import torch_layout

__all__ = ["StoredTensor", "TensorIndex", "owners", "merge", "file_format", "read_file_tensors",
           "tensor_index"]


@dataclasses.dataclass(frozen=True)
class TensorIndex:
    """The tensors of a checkpoint's ``files``: ``tensors`` maps each name to where it is stored,
    in the order of the files, then of each file's parser (read-only)."""

    files: CheckpointFiles
    tensors: Mapping[str, StoredTensor]

    def in_file_order(self) -> list[StoredTensor]:
        """The tensors sorted by file path, then byte offset: the order to read them in."""
        return sorted(self.tensors.values(), key=lambda t: (t.file, t.offset))


def owners(parts: Iterable[tuple[str, Iterable[str]]], files: CheckpointFiles) -> dict[str, str]:
    """Map each tensor name to the one file holding it, from ``(file, names in it)`` pairs; a
    name in two files, or not in the file ``files.weight_map`` names for it, raises
    :class:`CheckpointFormatError` naming the tensor and both files. Pure."""
    where: dict[str, str] = {}
    for file, names in parts:
        for name in names:
            first = where.setdefault(name, file)
            if first != file:
                raise CheckpointFormatError(f"tensor {name!r} is in both {first!r} and {file!r}; "
                                            "a checkpoint holds each tensor once")
    check_weight_map(files, where)
    return where


def merge(parts: Iterable[tuple[str, Mapping[str, StoredTensor]]], files: CheckpointFiles) -> TensorIndex:
    """One index from each file's tensors, under the rule of :func:`owners`. Pure."""
    parts = list(parts)
    owners(parts, files)
    merged = {name: stored for _, tensors in parts for name, stored in tensors.items()}
    return TensorIndex(files=files, tensors=types.MappingProxyType(merged))


def file_format(sniffed: Kind | None, named: Kind, kinds: Sequence[Kind]) -> Kind:
    """The parser for one file: the format its first bytes show (``sniffed``) if the caller reads
    it, else the format its name or folder layout promises (``named``) if the caller reads that,
    else the caller's first kind (whose parser then says what is wrong). Pure."""
    for kind in (sniffed, named):
        if kind is not None and kind in kinds:
            return kind
    return kinds[0]


def read_file_tensors(path: str, kind: Kind) -> dict[str, StoredTensor]:
    """The tensors of one file of format ``kind``, located by that format's parser (blocking;
    headers and ``data.pkl`` only)."""
    if kind == "safetensors":
        return locate(read_header(path), path)
    return torch_layout(path)


def tensor_index(path: str, *, kinds: Sequence[Kind] = ("safetensors", "torch"),
                 any_safetensors: bool = False) -> TensorIndex:
    """The index of the checkpoint at ``path``: a file, or a folder holding ``model.safetensors``,
    ``model.safetensors.index.json`` and its shards, ``pytorch_model.bin`` or
    ``pytorch_model.bin.index.json`` and its shards (searched in that order, among ``kinds``);
    with ``any_safetensors``, a folder with none of them gives every ``*.safetensors`` file in
    it. A file's format is told by its first bytes where the caller reads that format.
    Blocking; reads headers and ``data.pkl`` only. A malformed file, a tensor in two files or a
    ``weight_map`` the files contradict raises :class:`CheckpointFormatError`; a missing ``path``
    raises ``FileNotFoundError``."""
    files = find_checkpoint(path, kinds, any_safetensors=any_safetensors)
    return merge(((file, read_file_tensors(file, file_format(sniff_file(file), files.kind, kinds)))
                  for file in files.files), files)
