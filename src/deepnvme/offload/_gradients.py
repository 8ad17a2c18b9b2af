"""Taking a gradient from autograd into the store: written from a reused page-aligned buffer.

A resident (small) gradient stays in memory: autograd's tensor is kept, or copied or added into
the kept one. Autograd's gradient comes from torch's heap (not page-aligned), so it is copied into a buffer of
the store first: the engine then writes with O_DIRECT and no bounce buffers. The buffer comes
from :meth:`TensorStore.buffer` like a read's, so room is made first (an unpinned parameter, least
recently used, is evicted and its mapping reused) instead of mapping and page-faulting fresh
memory for every gradient. Memory: the store's budget, plus autograd's own gradient while this
runs (one tensor, freed by autograd after the hook).
"""

from __future__ import annotations

import torch

from ..errors import OffloadMemoryError
from ..memory.heap import mapped_empty
from ._entry import Buffer, Entry
from ._store import TensorStore

__all__ = ["accept_gradient"]

_PAGE = 4096


def accept_gradient(store: TensorStore, entry: Entry, grad: torch.Tensor) -> None:
    """Add ``grad`` to ``entry`` (a gradient entry: the first since zero_grad is stored, a later
    one is added to the stored one, as ``param.grad += grad``) and start writing it; or hand it
    to the optimizer's update fused into the backward (``store.on_gradient``), which then
    updates the parameter and stores nothing."""
    consumer = store.on_gradient
    if consumer is not None and not entry.valid and consumer(entry.param, grad):
        return
    with store.lock:
        if entry.resident:
            _keep(store, entry, grad)
            return
        if entry.valid:
            _accumulate(store, entry, grad)
            return
        buf: Buffer | None = None
        if grad.data_ptr() % _PAGE or not grad.is_contiguous():
            try:
                buf = store.buffer(entry.nbytes, demand=True, what=f"gradient of {entry.name}")
            except OffloadMemoryError:   # everything pinned: over the budget until writes end
                buf = None
            if buf is not None:
                grad = buf.typed(entry.dtype, entry.shape).copy_(grad)
            else:
                store.count(entry.nbytes)
                grad = mapped_empty(entry.nbytes).view(entry.dtype).view(entry.shape).copy_(grad)
        else:   # written from autograd's own (aligned) tensor
            store.admit(entry.nbytes, f"gradient of {entry.name}")
        store.store(entry, grad, keep=False, buf=buf)
        entry.valid = True


def _keep(store: TensorStore, entry: Entry, grad: torch.Tensor) -> None:
    """A resident gradient (its memory allocated at setup): the first since zero_grad is copied
    into it, a later one added to it."""
    assert entry.tensor is not None  # pack_resident allocated it; internal invariant
    if entry.valid:
        entry.tensor += grad             # what AccumulateGrad does: param.grad += grad
    else:
        entry.tensor.copy_(grad)
    entry.valid = True


def _accumulate(store: TensorStore, entry: Entry, grad: torch.Tensor) -> None:
    store.admit(entry.nbytes, f"gradient of {entry.name}")   # autograd's, until it is added
    try:
        store.fetch([entry], f"gradient of {entry.name}")
    except BaseException:
        store.uncount(entry.nbytes)
        raise
    try:
        assert entry.tensor is not None  # fetch made it present; internal invariant
        entry.tensor += grad             # what AccumulateGrad does: param.grad += grad
        del grad
        store.uncount(entry.nbytes)
    finally:
        store.unpin([entry])
    store.store(entry, entry.tensor, keep=False)
