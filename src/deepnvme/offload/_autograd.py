"""Autograd packing: the forward keeps references to offloaded parameters, not their memory.

While a hooked module runs its forward, saved-tensor hooks replace every saved parameter (or
view of one) by a :class:`SavedParam`: the entry and the view's size, stride and offset. When
the backward unpacks it, the parameter is read again (prefetching the units the learned backward
order expects next) and the same view is rebuilt on the fresh tensor. Memory: a few integers per
saved parameter; the parameter itself only while autograd uses the unpacked view.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks

from ._entry import Entry
from ._order import OrderTracker
from ._store import TensorStore
from ._units import Units

__all__ = ["SavedParam", "SavedParameters"]


class SavedParam:
    """What autograd keeps instead of a saved parameter (or a view of one)."""

    __slots__ = ("entry", "size", "stride", "offset")

    def __init__(self, entry: Entry, t: torch.Tensor, base: torch.Tensor) -> None:
        # the offset is relative to the parameter's data: a later read lands elsewhere
        self.entry, self.size, self.stride = entry, t.size(), t.stride()
        self.offset = t.storage_offset() - base.storage_offset()


class SavedParameters:
    """The saved-tensor hooks of one offloaded model, pushed around each hooked forward.

    ``push``/``pop`` nest like the modules' forwards (the root's outermost); :meth:`start_forward`
    marks that the next unpack begins a backward pass (for the backward order).
    """

    def __init__(self, store: TensorStore, units: Units, backward: OrderTracker) -> None:
        self._store = store
        self._units = units
        self._backward = backward
        self._pushed: list[tuple[int, saved_tensors_hooks]] = []
        self._backward_pending = False

    def start_forward(self) -> None:
        """A root forward begins: with grad enabled, a backward pass will follow."""
        self._backward_pending = torch.is_grad_enabled()

    def push(self, owner: int) -> None:
        """Pack what ``owner``'s forward saves (until :meth:`pop`)."""
        ctx = saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._pushed.append((owner, ctx))

    def pop(self, owner: int) -> bool:
        """Undo ``owner``'s push; False if its pre-hook failed before pushing."""
        if self._pushed and self._pushed[-1][0] == owner:
            self._pushed.pop()[1].__exit__(None, None, None)
            return True
        return False

    def _pack(self, t: torch.Tensor) -> torch.Tensor | SavedParam:
        if t.device.type != "cpu" or t.numel() == 0:
            return t
        entry = self._store.by_storage.get(t.untyped_storage().data_ptr())
        if entry is None or t.dtype != entry.dtype or entry.tensor is None:
            return t
        return SavedParam(entry, t, entry.tensor)

    def _unpack(self, saved: torch.Tensor | SavedParam) -> torch.Tensor:
        if not isinstance(saved, SavedParam):
            return saved
        entry = saved.entry
        if self._backward_pending:
            self._backward.start()
            self._backward_pending = False
        self._store.fetch([entry], f"parameter {entry.name} (backward)")
        try:
            assert entry.tensor is not None  # fetch made it present; internal invariant
            view = entry.tensor.as_strided(saved.size, saved.stride,
                                           entry.tensor.storage_offset() + saved.offset)
            ahead = self._backward.visit(self._units.first_holding(entry))
            if ahead:
                self._store.prefetch(self._units.members(ahead))
        finally:
            self._store.unpin([entry])
        return view
