"""Units: the offloaded parameters each hooked module fetches around its forward.

A unit is a module's own parameters (``recurse=False``), plus the external ones registered for
it; the forward and backward order trackers learn sequences of unit indices, and prefetching
the units expected next reads their entries.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ._entry import Entry

__all__ = ["Units"]


class Units:
    """The units of one offloaded model, in the order they were added.

    Memory: one list entry per offloaded parameter and module with parameters.
    """

    def __init__(self) -> None:
        self.entries: list[list[Entry]] = []    # per unit: the parameters' data entries
        self._of_module: dict[int, int] = {}    # id(module) -> its unit
        self._first: dict[int, int] = {}        # entry key -> the first unit holding it

    def add(self, module: torch.nn.Module, entries: list[Entry]) -> int:
        """A new unit for ``module`` holding ``entries`` (a list the unit keeps); its index."""
        index = len(self.entries)
        self.entries.append(entries)
        self._of_module[id(module)] = index
        for e in entries:
            self._first.setdefault(e.key, index)
        return index

    def of_module(self, module: torch.nn.Module) -> int | None:
        """The unit of ``module``, or None if it has none."""
        return self._of_module.get(id(module))

    def first_holding(self, entry: Entry) -> int:
        """The first unit that holds ``entry`` (its owning module's)."""
        return self._first[entry.key]

    def members(self, units: Iterable[int]) -> Iterator[Entry]:
        """The entries of ``units``, unit by unit."""
        return (e for u in units for e in self.entries[u])
