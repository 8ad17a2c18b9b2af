"""Per-item checksums of a DCP checkpoint, checked on the bytes a reader reads.

An item is one entry of a data file: a tensor (or a DTensor shard) saved by ``torch.save``, or
plain data's pickled bytes. Its checksum covers the item's bytes in the file, as the writer's
stream hashed them. Items are named by :func:`item_key`, as the writer names them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ...errors import CheckpointCorruptError
from ...memory.views import byte_view
from ._io import RunningHash

__all__ = ["ItemSums", "item_key"]


def item_key(index: MetadataIndex) -> str:
    """An item's name among the stored checksums: its key, ``@`` and its chunk's offsets for a
    tensor (``w@0,0``; a shard's offsets are where it starts)."""
    return index.fqn if index.offset is None else f"{index.fqn}@{','.join(str(o) for o in index.offset)}"


@dataclasses.dataclass
class ItemSums:
    """The stored checksums of a checkpoint's items (by :func:`item_key`) and the algorithm that
    made them; :meth:`check` compares the bytes read. ``checked``: items checked so far (the
    reader's thread only)."""

    algorithm: str
    sums: Mapping[str, int]
    running: Callable[[], RunningHash]
    checked: int = 0

    def check(self, index: MetadataIndex, path: str, *parts: torch.Tensor | memoryview) -> None:
        """Compare the item's bytes, ``parts`` in order (contiguous CPU tensors or buffers), with
        its stored checksum; :class:`CheckpointCorruptError` naming the file and item if they
        differ. Items without a stored checksum pass."""
        want = self.sums.get(item_key(index))
        if want is None:
            return
        running = self.running()
        for part in parts:
            running.update(byte_view(part) if isinstance(part, torch.Tensor) else part)
        self.checked += 1
        if running.value() != want:
            raise CheckpointCorruptError(f"{path!r}: item {item_key(index)!r} fails its {self.algorithm} "
                                         "checksum (its bytes changed after the save)")
