"""Hooks around modules: each module's parameters are fetched before its forward, released after.

A module's forward pre-hook reads its unit (its own parameters, pinned), pushes the saved-tensor
hooks and prefetches the next units in the learned forward order; its forward hook pops them and
unpins the unit. The root module's hooks, outermost, start each pass. Memory: none beyond the
store's budget; the hooks hold references to the units only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ..errors import OffloadMemoryError
from ._autograd import SavedParameters
from ._entry import Entry
from ._order import OrderTracker
from ._store import TensorStore
from ._units import Units

__all__ = ["ModuleHooks"]

_ROOT = -1   # the owner of the root module's own push


class ModuleHooks:
    """The forward hooks of one offloaded model (see the module doc); :meth:`remove` undoes them."""

    def __init__(self, model: torch.nn.Module, store: TensorStore, units: Units,
                 saved: SavedParameters, forward: OrderTracker) -> None:
        self._model = model
        self._store = store
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
        total = sum(e.nbytes for e in unit) + data.nbytes
        if total > self._store.budget:
            raise OffloadMemoryError(
                f"module {name or type(module).__name__!r} would need {total} bytes of parameters "
                f"with {data.name}, more than max_in_memory_bytes={self._store.budget}; raise it")
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
        self._forward.start()
        self._saved.start_forward()
        self._saved.push(_ROOT)

    def _root_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._saved.pop(_ROOT)

    def _pre_hook(self, unit: int, name: str) -> Any:
        entries = self._units.entries[unit]
        what = f"module {name or 'root'!r}"

        def hook(module: torch.nn.Module, args: Any) -> None:
            self._store.fetch(entries, what)
            self._saved.push(unit)
            ahead = self._forward.visit(unit)
            if ahead:
                self._store.prefetch(self._units.members(ahead))
        return hook

    def _post_hook(self, unit: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._saved.pop(unit):
                self._store.unpin(self._units.entries[unit])
        return hook
