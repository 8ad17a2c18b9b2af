"""Autograd packing: the forward keeps references to offloaded parameters, not their memory.

While a hooked module runs its forward, saved-tensor hooks replace every saved parameter (or
view of one) by a :class:`SavedParam`: the entry and the view's size, stride and offset. When
the backward unpacks it, the parameter is acquired again (prefetching the units the learned
backward order expects next) and the same view is rebuilt on the fresh tensor. Where the
parameters live while used (host memory, or device copies) is a :class:`Residence`, so the CPU
and device paths share these hooks. Memory: a few integers per saved parameter; the parameter
itself only while autograd uses the unpacked view.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch
from torch.autograd.graph import saved_tensors_hooks

from ._entry import Entry
from ._order import OrderTracker
from ._units import Units

__all__ = ["Residence", "SavedParam", "SavedParameters"]


class Residence(Protocol):
    """Where an offloaded model's parameters are while modules use them: the hooks acquire a
    unit before a module runs and release it after, and find the parameter a saved tensor views."""

    setting: str     # the budget's keyword, for errors ("max_in_memory_bytes")
    where: str       # where the budget applies, for errors ("" or " on the device")

    @property
    def budget(self) -> int:
        """Bytes of parameters the residence may hold."""

    def acquire(self, entries: list[Entry], what: str) -> None:
        """Make ``entries`` present and hold them until :meth:`release`; ``what`` names the user."""

    def release(self, entries: list[Entry]) -> None:
        """Stop holding ``entries`` (they may be evicted)."""

    def prefetch(self, entries: Iterable[Entry]) -> None:
        """Start making ``entries`` present, without waiting."""

    def unit_bytes(self, unit: list[Entry]) -> int:
        """The bytes of ``unit`` that count against the budget while it is acquired."""

    def viewed(self, t: torch.Tensor) -> tuple[Entry, torch.Tensor] | None:
        """The present parameter whose memory ``t`` views (with the parameter's tensor), or None."""

    def tensor(self, entry: Entry) -> torch.Tensor:
        """The present tensor of an acquired ``entry``."""

    def start_pass(self) -> None:
        """A root forward begins (finish what the previous backward left in flight)."""


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

    def __init__(self, residence: Residence, units: Units, backward: OrderTracker) -> None:
        self._residence = residence
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
        if t.numel() == 0:
            return t
        found = self._residence.viewed(t)
        if found is None or t.dtype != found[0].dtype:
            return t
        return SavedParam(found[0], t, found[1])

    def _unpack(self, saved: torch.Tensor | SavedParam) -> torch.Tensor:
        if not isinstance(saved, SavedParam):
            return saved
        entry = saved.entry
        if self._backward_pending:
            self._backward.start()
            self._backward_pending = False
        self._residence.acquire([entry], f"parameter {entry.name} (backward)")
        try:
            base = self._residence.tensor(entry)
            view = base.as_strided(saved.size, saved.stride, base.storage_offset() + saved.offset)
            ahead = self._backward.visit(self._units.first_holding(entry))
            if ahead:
                self._residence.prefetch(self._units.members(ahead))
        finally:
            self._residence.release([entry])
        return view
