"""The tensor index of a safetensors checkpoint folder (headers only, no tensor data).

The folder rules and the parsing are :func:`deepnvme.formats.index.tensor_index`'s: one
``model.safetensors``, the shards named by the ``weight_map`` of
``model.safetensors.index.json``, or else every ``*.safetensors`` file; absolute file offsets
for each tensor.
"""

from __future__ import annotations

from ..formats.index import tensor_index
from ..formats.safetensors import StoredTensor, locate

__all__ = ["CheckpointTensor", "locate", "read_checkpoint_index"]


CheckpointTensor = StoredTensor
"""One tensor of a checkpoint: ``nbytes`` at absolute byte ``offset`` of ``file``."""


def read_checkpoint_index(directory: str) -> dict[str, CheckpointTensor]:
    """Map every tensor name of the safetensors checkpoint in ``directory`` to its location; a
    tensor in two files or a ``weight_map`` the files contradict raises
    :class:`~deepnvme.errors.CheckpointFormatError`."""
    return dict(tensor_index(directory, kinds=("safetensors",), any_safetensors=True).tensors)
