"""Whole Hugging Face checkpoint folders for ``load`` and ``load_safetensors``: one merged dict."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import CheckpointFormatError
from ..formats.hf_index import Kind, find_checkpoint
from ..formats.index import owners

__all__ = ["load_folder"]


def load_folder(path: str, kind: Kind, load_file: Callable[[str], Any]) -> dict[str, Any]:
    """Load every file of the ``kind`` checkpoint in folder ``path`` with ``load_file`` and merge
    them; each file must hold a dict, a name in two files or not where the index says is a
    :class:`CheckpointFormatError` (:func:`deepnvme.formats.index.owners`). Memory: the merged
    result only (files are read one by one)."""
    files = find_checkpoint(path, kinds=(kind,))
    parts: list[tuple[str, dict[str, Any]]] = []
    for file in files.files:
        part = load_file(file)
        if not isinstance(part, dict):
            raise CheckpointFormatError(f"{file!r} holds a {type(part).__name__}, not a dict of tensors")
        parts.append((file, part))
    owners(parts, files)
    return {name: value for _, part in parts for name, value in part.items()}
