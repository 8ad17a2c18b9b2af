"""Hooks around modules: each module's parameters are acquired before its forward, released after.

A module's forward pre-hook acquires its unit (its own parameters: read and pinned in host
memory, or copied to the device), pushes the saved-tensor hooks and prefetches the next units in
the learned forward order; its forward hook pops them and releases the unit. The root module's
hooks, outermost, start each pass. Where the parameters are while used is a
:class:`~._autograd.Residence`: :class:`StoreResidence` here (host memory), the device path's in
:mod:`._device_hooks`. Memory: none beyond the residence's budget; the hooks hold references to
the units only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ..errors import OffloadMemoryError
from ._autograd import Residence, SavedParameters
from ._entry import Entry
from ._order import OrderTracker
from ._store import TensorStore
from ._units import Units

__all__ = ["ModuleHooks", "StoreResidence"]

_ROOT = -1   # the owner of the root module's own push


class StoreResidence:
    """Parameters in host memory while used: read from their files into the store's buffers
    (pinned while a module uses them) under ``max_in_memory_bytes``."""

    setting = "max_in_memory_bytes"
    where = ""

    def __init__(self, store: TensorStore) -> None:
        self._store = store

    @property
    def budget(self) -> int:
        return self._store.budget

    def acquire(self, entries: list[Entry], what: str) -> None:
        self._store.fetch(entries, what)

    def release(self, entries: list[Entry]) -> None:
        self._store.unpin(entries)

    def prefetch(self, entries: Iterable[Entry]) -> None:
        self._store.prefetch(entries)

    def unit_bytes(self, unit: list[Entry]) -> int:
        return sum(e.nbytes for e in unit)

    def viewed(self, t: torch.Tensor) -> tuple[Entry, torch.Tensor] | None:
        if t.device.type != "cpu":
            return None
        entry = self._store.by_storage.get(t.untyped_storage().data_ptr())
        return None if entry is None or entry.tensor is None else (entry, entry.tensor)

    def tensor(self, entry: Entry) -> torch.Tensor:
        if entry.tensor is None:
            raise RuntimeError(f"deepnvme: parameter {entry.name} is not in memory after it was fetched")
        return entry.tensor

    def start_pass(self) -> None:
        """Nothing is left in flight between passes on the host."""


class ModuleHooks:
    """The forward hooks of one offloaded model (see the module doc); :meth:`remove` undoes them."""

    def __init__(self, model: torch.nn.Module, residence: Residence, units: Units,
                 saved: SavedParameters, forward: OrderTracker) -> None:
        self._model = model
        self._residence = residence
        self._units = units
        self._saved = saved
        self._forward = forward
        self._handles: list[RemovableHandle] = []
        self._root_hooked = False

    def add(self, module: torch.nn.Module, name: str, unit: list[Entry]) -> None:
        """Fetch ``unit`` before ``module``'s forward and release it after. A unit added to the
        root module after the root hooks exist nests inside them: its pre-hook runs after the
        root's, its forward hook before."""
        index = self._units.add(module, unit)
        root = module is self._model and self._root_hooked
        self._handles.append(module.register_forward_pre_hook(self._pre_hook(index, name),
                                                              prepend=not root))
        self._handles.append(module.register_forward_hook(self._post_hook(index), prepend=root,
                                                          always_call=True))

    def add_external(self, module: torch.nn.Module, name: str, data: Entry) -> None:
        """Fetch ``data`` (a parameter another module owns) for ``module``'s forward too;
        ``name`` is the module's qualified name. Raises :class:`OffloadMemoryError` if the
        module's unit would no longer fit the budget."""
        index = self._units.of_module(module)
        unit = [] if index is None else self._units.entries[index]
        if data in unit:
            return
        r = self._residence
        total = r.unit_bytes([*unit, data])
        if total > r.budget:
            raise OffloadMemoryError(
                f"module {name or type(module).__name__!r} would need {total} bytes of parameters"
                f"{r.where} with {data.name}, more than {r.setting}={r.budget}; raise it")
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

    def _root_pre(self, module: torch.nn.Module, args: Any) -> None:
        self._residence.start_pass()
        self._forward.start()
        self._saved.start_forward()
        self._saved.push(_ROOT)

    def _root_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._saved.pop(_ROOT)

    def _pre_hook(self, unit: int, name: str) -> Any:
        entries = self._units.entries[unit]
        what = f"module {name or 'root'!r}"

        def hook(module: torch.nn.Module, args: Any) -> None:
            self._residence.acquire(entries, what)
            self._saved.push(unit)
            ahead = self._forward.visit(unit)
            if ahead:
                self._residence.prefetch(self._units.members(ahead))
        return hook

    def _post_hook(self, unit: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._saved.pop(unit):
                self._residence.release(self._units.entries[unit])
        return hook
