"""The optimizer's side of a parameter offload: :class:`~deepnvme.optim._protocol.OffloadedParameters`,
the protocol through which :class:`~deepnvme.NVMeOptimizer` updates offloaded parameters.

Each optimizer sub-group's parameters and gradients are brought in (``begin_update``), the next
sub-group's are read ahead (``prefetch_update``), and the updated parameters are written back
(``end_update``) while the next sub-group updates; ``finish_updates`` ends the step. A
parameter larger than a sub-group is updated in slices: each slice of its file and of its
gradient's is read into a buffer of the store, and the updated slice written back to its
place in the file; the parameter is never whole in memory (it is let go before its first
slice, so no stale copy outlives the step).
Memory: one sub-group's parameters and gradients (or one slice of each) plus the next one's
read ahead, within the offload's budget (``update_bytes`` sizes the sub-groups so).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..errors import OffloadMemoryError
from ..memory.heap import trim_heap
from ..optim._protocol import OffloadedParameters
from ._entry import Buffer, Entry
from ._store import TensorStore

__all__ = ["UpdateSide"]


@dataclass
class _Slice:
    """One slice in memory for an update: its data and gradient, and the store buffers and
    reads behind them (none for a resident tensor's view)."""

    data: torch.Tensor
    grad: torch.Tensor | None
    data_buf: Buffer | None = None
    grad_buf: Buffer | None = None
    reads: list[Future[torch.Tensor]] = field(default_factory=list)


class UpdateSide(OffloadedParameters):
    """Mixed into :class:`~deepnvme.offload.ParameterOffload` (which sets both attributes)."""

    #: every gradient reaches :meth:`set_gradient_consumer`'s consumer (``fuse_backward`` works)
    fused_gradients = True
    #: give the heap's free memory back at the end of each step (see :meth:`finish_updates`)
    trim_each_step = True

    _store: TensorStore
    _entries: dict[int, tuple[Entry, Entry]]   # id(param) -> (data, grad)
    # made on first use (the offload's constructor does not know of slices)
    _slices_in_memory: dict[tuple[int, int], _Slice]   # (data key, start) -> slice read in
    _slice_writes: list[Future[None]]                  # this step's slice writes

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
        """The optimizer step ended: let slices read ahead go, wait for the slices' writes
        (raising the first failure), and give the heap's free memory back to the OS.

        Trimming once per step, not per sub-group: autograd's gradients and the optimizer's
        temporaries come from torch's heap, and within a step each sub-group reuses what the
        previous one freed (trimming after each made every temporary page-fault afresh). Not at
        all where :attr:`trim_each_step` is False (an FSDP2 job: the heap's free memory is then
        mostly FSDP's all-gather and reduce-scatter buffers, allocated again every step)."""
        slices = self._open_slices()
        for key in list(slices):
            self._let_go(slices.pop(key), write=None)
        writes = self._slice_write_list()
        self._slice_writes = []
        if self.trim_each_step:
            trim_heap()
        for fut in writes:
            fut.result()

    def set_gradient_consumer(self, consumer: Callable[[torch.Tensor, torch.Tensor], bool] | None
                              ) -> None:
        """Hand each new gradient to ``consumer`` first (see the protocol); None: store them."""
        self._store.on_gradient = consumer

    def set_update_notice(self, notice: Callable[[list[torch.Tensor]], None] | None) -> None:
        """Tell ``notice`` which parameters' gradients come soon (see the protocol); None: off."""
        self._store.on_awaited = notice

    # --- slices of a parameter larger than a sub-group --------------------------------------

    def _open_slices(self) -> dict[tuple[int, int], _Slice]:
        found: dict[tuple[int, int], _Slice] | None = getattr(self, "_slices_in_memory", None)
        if found is None:
            found = self._slices_in_memory = {}
        return found

    def _slice_write_list(self) -> list[Future[None]]:
        found: list[Future[None]] | None = getattr(self, "_slice_writes", None)
        if found is None:
            found = self._slice_writes = []
        return found

    def _entry_pair(self, param: torch.Tensor) -> tuple[Entry, Entry]:
        pair = self._entries.get(id(param))
        if pair is None:
            raise ValueError(f"a parameter of shape {list(param.shape)} is not held by this offload")
        return pair

    def _forget_whole(self, d: Entry, g: Entry) -> None:
        """Let a present copy of the whole parameter (or gradient) go: its file is updated in
        slices now, and a copy kept would go stale."""
        for e in (d, g):
            if e.tensor is not None and not e.resident:
                if e.pins:
                    raise RuntimeError(f"{e.name} is in use while the optimizer updates it")
                self._store.drop(e)

    def _read_slice(self, d: Entry, g: Entry, start: int, stop: int, *, demand: bool) -> _Slice | None:
        store = self._store
        with store.lock:
            self._forget_whole(d, g)
            what = f"optimizer slice {start}..{stop} of {d.name}"
            if d.resident:
                assert d.tensor is not None  # resident entries keep their tensor; internal invariant
                out = _Slice(d.tensor.view(-1)[start:stop], None)
            else:
                got = store.read_range(d, start, stop, demand=demand, what=what)
                if got is None:
                    return None
                out = _Slice(got[0], None, data_buf=got[1], reads=[got[2]])
            if g.valid and g.resident:
                assert g.tensor is not None  # kept gradients have their tensor; internal invariant
                out.grad = g.tensor.view(-1)[start:stop]
            elif g.valid:
                got = store.read_range(g, start, stop, demand=demand, what=what + " (gradient)")
                if got is None:
                    self._let_go(out, write=None)
                    return None
                out.grad, out.grad_buf = got[0], got[1]
                out.reads.append(got[2])
            return out

    def prefetch_slice(self, param: torch.Tensor, start: int, stop: int) -> None:
        """Start reading a slice of ``param`` and of its gradient, if the budget has room."""
        d, g = self._entry_pair(param)
        slices = self._open_slices()
        if (d.key, start) not in slices:
            got = self._read_slice(d, g, start, stop, demand=False)
            if got is not None:
                slices[(d.key, start)] = got

    def begin_slice(self, param: torch.Tensor, start: int,
                    stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Elements ``start..stop`` of ``param`` and of its gradient, read in; blocks."""
        d, g = self._entry_pair(param)
        got = self._open_slices().get((d.key, start))
        if got is None:
            got = self._read_slice(d, g, start, stop, demand=True)
            assert got is not None  # a demand gets its buffers or raises
            self._open_slices()[(d.key, start)] = got
        try:
            for fut in got.reads:
                fut.result()
        except BaseException:
            self._let_go(self._open_slices().pop((d.key, start)), write=None)
            raise
        got.reads = []
        if d.resident:
            self._store.backups[d.key].view(-1)[start:stop].copy_(got.data)
        return got.data, got.grad

    def end_slice(self, param: torch.Tensor, start: int, stop: int) -> None:
        """Write the updated slice to its place in the file; let the slices' buffers go."""
        d, _ = self._entry_pair(param)
        got = self._open_slices().pop((d.key, start))
        write = None
        if got.data_buf is not None:
            write = self._store.write_range(d, got.data, start)
            self._slice_write_list().append(write)
        self._let_go(got, write=write)

    def abort_slice(self, param: torch.Tensor, start: int, stop: int) -> None:
        """The slice's update failed: the file keeps the values from before it (a resident
        parameter gets them back from its backup)."""
        d, _ = self._entry_pair(param)
        got = self._open_slices().pop((d.key, start), None)
        if got is None:
            return
        if d.resident:
            got.data.copy_(self._store.backups[d.key].view(-1)[start:stop])
        self._let_go(got, write=None)

    def _let_go(self, got: _Slice, *, write: Future[None] | None) -> None:
        """Give back a slice's buffers (the data's once ``write`` ended; a read still in flight
        keeps its buffer until it lands)."""
        def pending(fut: Future[torch.Tensor] | None) -> Future[torch.Tensor] | None:
            return fut if fut is not None and not fut.done() else None  # a done read holds a view
        n_data = got.data.numel() * got.data.element_size()
        n_grad = 0 if got.grad is None else got.grad.numel() * got.grad.element_size()
        data_buf, grad_buf = got.data_buf, got.grad_buf
        data_io: Future[None] | Future[torch.Tensor] | None = write
        grad_io = None
        if got.reads:
            if data_buf is not None:
                data_io = data_io or pending(got.reads[0])
            if grad_buf is not None:
                grad_io = pending(got.reads[-1])
        got.reads, got.data_buf, got.grad_buf = [], None, None
        del got   # the slices' tensors go with it: the buffers become reusable
        if grad_buf is not None:
            self._store.release_range(grad_buf, n_grad, grad_io)
        if data_buf is not None:
            self._store.release_range(data_buf, n_data, data_io)
