"""One offloaded tensor (:class:`Entry`), the mapping behind it (:class:`Buffer`), and the
placeholder a released parameter holds.

An entry is a parameter's data or its gradient; its value is in its file, or present (a tensor
in a store buffer), or resident (a small tensor kept in memory for good). A buffer is a uint8
mapping the store allocated and may hand out again once nothing else uses its storage.
A parameter entry shows its present value as the parameter's ``.data``, or through a
:class:`Home` where other tensors must see it too (an FSDP2 shard: see :mod:`._fsdp`).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol

import torch

from ..memory.heap import mapped_empty

__all__ = ["Buffer", "Entry", "Home", "placeholder"]

_PLACEHOLDERS: dict[torch.dtype, torch.Tensor] = {}


def placeholder(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` that holds one element (NaN for floating types)."""
    base = _PLACEHOLDERS.get(dtype)
    if base is None:
        fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
        base = _PLACEHOLDERS[dtype] = torch.full((1,), fill, dtype=dtype)
    return base.expand(shape) if len(shape) else base.view(())


class Home(Protocol):
    """Where a parameter entry's value shows besides (or instead of) ``param.data``."""

    shape: torch.Size   # the stored tensor's shape (it may hold padding beyond the parameter)

    def show(self, tensor: torch.Tensor) -> None:
        """Make the parameter's users see ``tensor`` (of :attr:`shape`), without a copy."""
        ...

    def hide(self) -> None:
        """Point the parameter's users at a placeholder: the value left memory."""
        ...


class Entry:
    """One offloaded tensor: a parameter's data (``grad=False``) or its gradient."""

    __slots__ = ("key", "name", "param", "grad", "shape", "dtype", "nbytes", "tensor", "read",
                 "write", "pins", "tick", "prefetched", "awaited", "valid", "buf", "resident",
                 "home")

    def __init__(self, key: int, name: str, param: torch.nn.Parameter, *, grad: bool,
                 home: Home | None = None) -> None:
        self.key = key
        self.name = name                  # the parameter's qualified name (for messages)
        self.param = param
        self.grad = grad
        self.home = None if grad else home
        self.shape = param.shape if self.home is None else self.home.shape
        self.dtype = param.dtype
        self.nbytes = self.shape.numel() * param.element_size()
        self.tensor: torch.Tensor | None = None   # present value (maybe still being read)
        self.read: Future[torch.Tensor] | None = None
        self.write: Future[None] | None = None    # the last write of ``tensor``
        self.pins = 0
        self.tick = 0
        self.prefetched = False
        self.awaited = False    # used again soon (an FSDP2 shard, by its update): evicted last
        self.valid = not grad             # a gradient is valid once one was accumulated
        self.buf: Buffer | None = None   # the reusable mapping behind ``tensor``, if any
        self.resident = False   # a small tensor kept in memory: no file I/O, never dropped

    def show(self, tensor: torch.Tensor) -> None:
        """A parameter entry's value is present as ``tensor``: the parameter uses it."""
        if self.home is None:
            if self.param.data is not tensor:
                self.param.data = tensor
        else:
            self.home.show(tensor)

    def hide(self) -> None:
        """A parameter entry's value left memory: the parameter holds its placeholder."""
        if self.home is None:
            self.param.data = placeholder(self.shape, self.dtype)
        else:
            self.home.hide()


def _use_count(t: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class Buffer:
    """A mapping the store allocated (uint8) and the storage use count it has when unshared."""

    __slots__ = ("raw", "alone")

    def __init__(self, nbytes: int) -> None:
        self.raw = mapped_empty(nbytes)
        self.alone = _use_count(self.raw)

    def unshared(self) -> bool:
        """True if no tensor besides ``raw`` (a parameter's ``.data``, an autograd view) uses it."""
        return _use_count(self.raw) == self.alone

    def typed(self, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
        return self.raw.view(dtype).view(shape)
