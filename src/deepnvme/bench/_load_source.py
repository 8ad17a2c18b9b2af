"""What ``deepnvme bench load PATH`` reads: the checkpoint's format (from the files' first
bytes, not their names) and its files (one file, or a Hugging Face model directory)."""

from __future__ import annotations

import dataclasses
import os

from ..errors import CheckpointFormatError, UsageError
from ..formats import hf_index
from ..formats.hf_index import sniff

__all__ = ["SAFETENSORS", "TORCH", "Checkpoint", "find_checkpoint"]

SAFETENSORS = "safetensors"
TORCH = "torch"  # a torch.save zip archive


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A checkpoint on disk: ``path`` as given, its ``format`` and its ``files`` (absolute, in
    order); ``nbytes`` is the files' total size (what GB/s is computed from)."""

    path: str
    format: str
    files: tuple[str, ...]
    nbytes: int

    @property
    def is_dir(self) -> bool:
        return os.path.isdir(self.path)


def _format_of(path: str) -> str:
    """The format of one file; :class:`UsageError` (exit 2) if it is neither."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
            size = os.fstat(f.fileno()).st_size
    except OSError as exc:
        raise UsageError(f"cannot read {path!r}: {exc.strerror}") from None
    fmt = sniff(head, size)
    if fmt is None:
        raise UsageError(f"{path!r} is neither a .safetensors file nor a torch.save (zip) file; "
                         "give one of those or a Hugging Face model directory")
    return fmt


def _dir_files(path: str) -> tuple[list[str], str]:
    """The files of a Hugging Face model directory and the format its names promise, found by
    the loaders' own rules (:func:`deepnvme.formats.hf_index.find_checkpoint`)."""
    try:
        found = hf_index.find_checkpoint(path)
    except CheckpointFormatError as exc:
        raise UsageError(str(exc)) from None
    return list(found.files), SAFETENSORS if found.kind == "safetensors" else TORCH


def find_checkpoint(path: str) -> Checkpoint:
    """Resolve ``path`` (a file or a model directory); :class:`UsageError` names what is wrong."""
    if not os.path.exists(path):
        raise UsageError(f"{path!r} does not exist")
    if os.path.isdir(path):
        files, expected = _dir_files(path)
        for f in files:
            if (fmt := _format_of(f)) != expected:
                raise UsageError(f"{f!r} holds {fmt} data, not {expected}")
    else:
        files, expected = [path], _format_of(path)
    files = [os.path.abspath(f) for f in files]
    return Checkpoint(path=path, format=expected, files=tuple(files),
                      nbytes=sum(os.path.getsize(f) for f in files))
