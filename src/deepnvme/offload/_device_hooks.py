"""Where a model trained on a device keeps its parameters while modules use them: device copies.

The module and saved-tensor hooks are the CPU path's (:mod:`._hooks`, :mod:`._autograd`); this
:class:`~._autograd.Residence` makes them acquire a unit on the device (read, copied, the compute
stream waiting for the copy) and release it after, under ``max_device_bytes``. Each forward
first finishes the gradients of the previous backward still in flight. Memory: none beyond
:class:`DeviceCopies`' budget.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ._device_copies import DeviceCopies
from ._device_grads import DeviceGradients
from ._entry import Entry

__all__ = ["DeviceResidence"]


class DeviceResidence:
    """Parameters as device copies while used (see the module doc)."""

    setting = "max_device_bytes"
    where = " on the device"

    def __init__(self, copies: DeviceCopies, grads: DeviceGradients) -> None:
        self._copies = copies
        self._grads = grads

    @property
    def budget(self) -> int:
        return self._copies.budget

    def acquire(self, entries: list[Entry], what: str) -> None:
        self._copies.acquire(entries, what)

    def release(self, entries: list[Entry]) -> None:
        self._copies.release(entries)

    def prefetch(self, entries: Iterable[Entry]) -> None:
        self._copies.prefetch(entries)

    def unit_bytes(self, unit: list[Entry]) -> int:
        """Resident (small) parameters keep their device copy for good: not counted."""
        return sum(e.nbytes for e in unit if not e.resident)

    def viewed(self, t: torch.Tensor) -> tuple[Entry, torch.Tensor] | None:
        if t.device != self._copies.device.device:
            return None
        copy = self._copies.by_storage.get(t.untyped_storage().data_ptr())
        return None if copy is None or copy.resident else (copy.entry, copy.tensor)

    def tensor(self, entry: Entry) -> torch.Tensor:
        return self._copies.tensor(entry)

    def start_pass(self) -> None:
        self._grads.drain()
