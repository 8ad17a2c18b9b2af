"""The tensor index of a safetensors checkpoint folder (headers only, no tensor data).

Headers are parsed by :mod:`deepnvme.formats.safetensors`; this module adds the folder rules:
one ``model.safetensors`` or shards named by the ``weight_map`` of
``model.safetensors.index.json``, and absolute file offsets for each tensor.
"""

from __future__ import annotations

import os

from ..errors import DeepNVMeError
from ..formats.hf_index import parse_index
from ..formats.safetensors import StoredTensor, locate, read_header

__all__ = ["CheckpointTensor", "locate", "read_checkpoint_index"]


CheckpointTensor = StoredTensor
"""One tensor of a checkpoint: ``nbytes`` at absolute byte ``offset`` of ``file``."""


def _shards(index_path: str) -> list[str]:
    """The shard file names listed by the ``weight_map`` of a ``model.safetensors.index.json``."""
    with open(index_path, "rb") as f:
        return sorted(set(parse_index(f.read(), file=index_path).values()))


def read_checkpoint_index(directory: str) -> dict[str, CheckpointTensor]:
    """Map every tensor name of the safetensors checkpoint in ``directory`` to its location."""
    index_path = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index_path):
        files = _shards(index_path)
    else:
        files = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    if not files:
        raise DeepNVMeError(f"no *.safetensors files in {directory!r}; save the model with "
                            "save_pretrained(..., safe_serialization=True) first")
    out: dict[str, CheckpointTensor] = {}
    for name in files:
        path = os.path.join(directory, name)
        for key, rec in locate(read_header(path), path).items():
            if key in out:
                raise DeepNVMeError(f"tensor {key!r} appears in both {out[key].file} and {rec.file}")
            out[key] = rec
    return out
