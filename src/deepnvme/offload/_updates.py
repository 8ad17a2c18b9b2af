"""The optimizer's side of a parameter offload: :class:`~deepnvme.optim._protocol.OffloadedParameters`,
the protocol through which :class:`~deepnvme.NVMeOptimizer` updates offloaded parameters.

Each optimizer sub-group's parameters and gradients are brought in (``begin_update``), the next
sub-group's are read ahead (``prefetch_update``), and the updated parameters are written back
(``end_update``) while the next sub-group updates; ``finish_updates`` ends the step.
Memory: one sub-group's parameters and gradients plus the next one's read ahead, within the
offload's budget (``update_bytes`` sizes the sub-groups so).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ..errors import OffloadMemoryError
from ..memory.heap import trim_heap
from ..optim._protocol import OffloadedParameters
from ._entry import Entry
from ._store import TensorStore

__all__ = ["UpdateSide"]


class UpdateSide(OffloadedParameters):
    """Mixed into :class:`~deepnvme.offload.ParameterOffload` (which sets both attributes)."""

    _store: TensorStore
    _entries: dict[int, tuple[Entry, Entry]]   # id(param) -> (data, grad)

    def _pairs(self, params: Iterable[torch.Tensor]) -> Iterator[tuple[torch.Tensor, Entry, Entry]]:
        for p in params:
            pair = self._entries.get(id(p))
            if pair is not None:
                yield p, pair[0], pair[1]

    def zero_grad(self) -> None:
        """Forget every stored gradient (as ``optimizer.zero_grad()``; no I/O)."""
        with self._store.lock:
            for _, g in self._entries.values():
                g.valid = False
                if g.pins == 0:
                    self._store.drop(g)

    def update_bytes(self) -> int:
        """The parameter bytes an optimizer sub-group may have: its parameters and gradients,
        and those of the next sub-group read ahead, fit the budget."""
        return max(1, self._store.budget // 4)

    def check_updatable(self, params: Iterable[torch.Tensor]) -> None:
        """Raise :class:`OffloadMemoryError` now, naming the parameter, if one of ``params``
        cannot be updated: its update holds it and its gradient in memory together, beside the
        resident small parameters (found when the optimizer is built, not after a backward)."""
        store = self._store
        room = store.budget - store.resident_bytes
        for p, d, g in self._pairs(params):
            need = d.nbytes * (2 if p.requires_grad and not g.resident else 1)
            if not d.resident and need > room:
                raise OffloadMemoryError(
                    f"parameter {d.name} needs {need} bytes in memory for its optimizer update "
                    f"(its {d.nbytes} bytes and its gradient's) but max_in_memory_bytes="
                    f"{store.budget} leaves {room} beside the resident small parameters; raise "
                    f"max_in_memory_bytes to at least {need + store.resident_bytes}")

    def prefetch_update(self, params: Iterable[torch.Tensor]) -> None:
        """Start reading ``params`` and their gradients for an optimizer update."""
        self._store.prefetch(e for _, d, g in self._pairs(params) for e in (d, g))

    def begin_update(self, params: Iterable[torch.Tensor]) -> None:
        """Bring ``params`` and their gradients in (as ``.data`` and ``.grad``) for an update."""
        triples = list(self._pairs(params))
        for _, d, _ in triples:
            if d.write is not None:
                d.write.result()   # the update writes into the tensor a previous write reads
        needed = [d for _, d, _ in triples] + [g for _, _, g in triples if g.valid]
        self._store.fetch(needed, "an optimizer sub-group (parameters and gradients)")
        for _, d, _ in triples:
            if d.resident and d.tensor is not None:   # no file to fall back on if it fails
                self._store.backups[d.key].copy_(d.tensor)
        for p, _, g in triples:
            p.grad = g.tensor if g.valid else None

    def abort_update(self, params: Iterable[torch.Tensor]) -> None:
        """An update failed: unpin without writing (the files keep the values before it;
        resident parameters get theirs back from the copy begin_update made)."""
        with self._store.lock:
            for p, d, g in self._pairs(params):
                p.grad = None
                self._store.unpin([d, g] if g.valid else [d])
                if d.resident and d.tensor is not None:
                    d.tensor.copy_(self._store.backups[d.key])
                self._store.drop(d)

    def end_update(self, params: Iterable[torch.Tensor]) -> None:
        """Write the updated ``params`` and let them and their gradients go."""
        store = self._store
        with store.lock:
            for p, d, g in self._pairs(params):
                p.grad = None
                if g.valid:
                    store.unpin([g])
                    store.drop(g)
                assert d.tensor is not None  # begin_update made it present; internal invariant
                if not d.resident:
                    store.store(d, d.tensor, keep=True)
                store.unpin([d])

    def finish_updates(self) -> None:
        """The optimizer step ended: give the heap's free memory back to the OS.

        Once per step, not per sub-group: autograd's gradients and the optimizer's temporaries
        come from torch's heap, and within a step each sub-group reuses what the previous one
        freed (trimming after each made every temporary page-fault afresh)."""
        trim_heap()
