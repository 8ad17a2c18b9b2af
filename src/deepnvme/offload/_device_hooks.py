"""Hooks of a model trained on a device: parameters copied in around modules and for autograd.

The shape of the CPU path's hooks (:mod:`._hooks`, :mod:`._autograd`) with device copies: a
module's forward pre-hook acquires its unit on the device (read, copied, the compute stream
waiting for the copy) and prefetches the next units in the learned forward order; its forward
hook releases the unit. Saved-tensor hooks replace each saved device parameter (or view of
one) by a reference; unpacking it in the backward acquires the parameter again and prefetches
the units the learned backward order expects next. Each forward first finishes the gradients
of the previous backward still in flight. Memory: none beyond :class:`DeviceCopies`' budget.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks
from torch.utils.hooks import RemovableHandle

from ..errors import OffloadMemoryError
from ._autograd import SavedParam
from ._device_copies import DeviceCopies
from ._device_grads import DeviceGradients
from ._entry import Entry
from ._order import OrderTracker
from ._units import Units

__all__ = ["DeviceHooks"]

_ROOT = -1   # the owner of the root module's own push


class DeviceHooks:
    """The forward and saved-tensor hooks of one model trained on a device; :meth:`remove`
    undoes them. Units are added as :class:`~._hooks.ModuleHooks` adds them."""

    def __init__(self, model: torch.nn.Module, copies: DeviceCopies, grads: DeviceGradients,
                 units: Units, forward: OrderTracker, backward: OrderTracker) -> None:
        self._model = model
        self._copies = copies
        self._grads = grads
        self._units = units
        self._forward = forward
        self._backward = backward
        self._handles: list[RemovableHandle] = []
        self._root_hooked = False
        self._pushed: list[tuple[int, saved_tensors_hooks]] = []
        self._backward_pending = False

    def add(self, module: torch.nn.Module, name: str, unit: list[Entry]) -> None:
        """Acquire ``unit`` before ``module``'s forward, release it after (a unit of the root
        added after :meth:`install_root` nests inside the root's hooks)."""
        index = self._units.add(module, unit)
        root = module is self._model and self._root_hooked
        self._handles.append(module.register_forward_pre_hook(self._pre_hook(index, name),
                                                              prepend=not root))
        self._handles.append(module.register_forward_hook(self._post_hook(index), prepend=root,
                                                          always_call=True))

    def add_external(self, module: torch.nn.Module, name: str, data: Entry) -> None:
        """Acquire ``data`` (owned by another module) for ``module``'s forward too; raises
        :class:`OffloadMemoryError` if the unit would no longer fit the device budget."""
        index = self._units.of_module(module)
        unit = [] if index is None else self._units.entries[index]
        if data in unit:
            return
        total = sum(e.nbytes for e in unit if not e.resident) + data.nbytes
        if total > self._copies.budget:
            raise OffloadMemoryError(
                f"module {name or type(module).__name__!r} would need {total} bytes of "
                f"parameters on the device with {data.name}, more than max_device_bytes="
                f"{self._copies.budget}; raise it")
        if index is None:
            self.add(module, name, [data])
        else:
            unit.append(data)

    def install_root(self) -> None:
        """The root module's outermost hooks: each forward starts a pass."""
        self._handles.append(self._model.register_forward_pre_hook(self._root_pre, prepend=True))
        self._handles.append(self._model.register_forward_hook(self._root_post, always_call=True))
        self._root_hooked = True

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # --- forward -------------------------------------------------------------------------

    def _root_pre(self, module: torch.nn.Module, args: Any) -> None:
        self._grads.drain()
        self._forward.start()
        self._backward_pending = torch.is_grad_enabled()
        self._push(_ROOT)

    def _root_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._pop(_ROOT)

    def _pre_hook(self, unit: int, name: str) -> Any:
        entries = self._units.entries[unit]
        what = f"module {name or 'root'!r}"

        def hook(module: torch.nn.Module, args: Any) -> None:
            self._copies.acquire(entries, what)
            self._push(unit)
            ahead = self._forward.visit(unit)
            if ahead:
                self._copies.prefetch(self._units.members(ahead))
        return hook

    def _post_hook(self, unit: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._pop(unit):
                self._copies.release(self._units.entries[unit])
        return hook

    # --- autograd ------------------------------------------------------------------------

    def _push(self, owner: int) -> None:
        ctx = saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._pushed.append((owner, ctx))

    def _pop(self, owner: int) -> bool:
        """Undo ``owner``'s push; False if its pre-hook failed before pushing."""
        if self._pushed and self._pushed[-1][0] == owner:
            self._pushed.pop()[1].__exit__(None, None, None)
            return True
        return False

    def _pack(self, t: torch.Tensor) -> torch.Tensor | SavedParam:
        if t.numel() == 0 or t.device != self._copies.device.device:
            return t
        copy = self._copies.by_storage.get(t.untyped_storage().data_ptr())
        if copy is None or copy.resident or t.dtype != copy.entry.dtype:
            return t
        return SavedParam(copy.entry, t, copy.tensor)

    def _unpack(self, saved: torch.Tensor | SavedParam) -> torch.Tensor:
        if not isinstance(saved, SavedParam):
            return saved
        entry = saved.entry
        if self._backward_pending:
            self._backward.start()
            self._backward_pending = False
        self._copies.acquire([entry], f"parameter {entry.name} (backward)")
        try:
            base = self._copies.tensor(entry)
            view = base.as_strided(saved.size, saved.stride, base.storage_offset() + saved.offset)
            ahead = self._backward.visit(self._units.first_holding(entry))
            if ahead:
                self._copies.prefetch(self._units.members(ahead))
        finally:
            self._copies.release([entry])
        return view
