"""Values for a model built on the meta device: one tensor at a time, from a checkpoint or an init.

A meta-device model holds no data; :func:`~deepnvme.offload_parameters` asks a source for each
parameter (and meta buffer) in turn and writes it to its file before asking for the next, so the
model never exists whole in memory. Sources: a safetensors checkpoint (one file, or a folder with
``model.safetensors`` or a sharded index), read tensor by tensor through an :class:`AioHandle`;
or a function ``init(name, tensor)`` that fills an uninitialised tensor in place.
Memory: one tensor (the largest) at a time, plus the handle's bounce buffers; tensors of
``MAPPED_MIN`` or more are read into their own mappings, so each one's memory goes back to the
system when it was written (from the heap, freed reads stayed: peak RSS as large as the model).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch

from ..config import IOConfig
from ..errors import CheckpointMismatchError
from ..formats.index import tensor_index
from ..handles.aio import AioHandle
from ..memory.heap import mapped_at, mapped_empty

__all__ = ["Init", "Source", "make_source"]

Init = Callable[[str, torch.Tensor], None]


class Source:
    """Gives the value of a tensor known by ``names`` (its aliases in the model)."""

    def value(self, names: Sequence[str], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the source holds (files, handles)."""


class _InitSource(Source):
    def __init__(self, init: Init) -> None:
        self._init = init

    def value(self, names: Sequence[str], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        out = mapped_empty(nbytes).view(dtype).view(shape)
        with torch.no_grad():
            self._init(names[0], out)
        return out


class _CheckpointSource(Source):
    def __init__(self, path: str, config: IOConfig | None) -> None:
        self.path = path
        self._stored = tensor_index(path, kinds=("safetensors",)).tensors
        self._handle = AioHandle(config=config)

    def value(self, names: Sequence[str], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        stored = next((self._stored[n] for n in names if n in self._stored), None)
        if stored is None:
            raise CheckpointMismatchError(f"checkpoint {self.path!r} has no tensor named "
                                          f"{' or '.join(map(repr, names))}, which the model needs")
        if tuple(stored.shape) != tuple(shape):
            raise CheckpointMismatchError(
                f"checkpoint {self.path!r}: tensor {stored.name!r} has shape {list(stored.shape)} "
                f"in {os.path.basename(stored.file)!r} but the model's has {list(shape)}")
        raw = mapped_at(stored.nbytes, stored.offset)
        self._handle.submit_read(raw, stored.file, offset=stored.offset).result()
        value = raw.view(stored.dtype).view(stored.shape)
        if stored.dtype == dtype:
            return value
        nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
        return mapped_empty(nbytes).view(dtype).view(shape).copy_(value)

    def close(self) -> None:
        self._handle.close()


def make_source(source: str | os.PathLike[str] | Init | None, config: IOConfig | None) -> Source | None:
    """The source for ``offload_parameters(source=...)``: a checkpoint path or an init function."""
    if source is None:
        return None
    if callable(source):
        return _InitSource(source)
    if isinstance(source, (str, os.PathLike)):
        return _CheckpointSource(os.fspath(source), config)
    raise TypeError(f"source must be a safetensors checkpoint path or a function "
                    f"init(name, tensor), got {type(source).__name__}")
