"""Awaited entries in the offload's store (an FSDP2 shard between its backward all-gather and
its update): a read ahead never evicts one, a demand evicts one only when nothing else can go."""

import torch
from torch import nn

from deepnvme.memory.heap import MAPPED_MIN
from deepnvme.offload._entry import Entry
from deepnvme.offload._store import TensorStore


def _store(tmp_path, n, budget):
    store = TensorStore(tmp_path, budget=budget, config=None)
    entries = []
    for i in range(n):
        p = nn.Parameter(torch.full((MAPPED_MIN // 4,), float(i + 1)))
        e = Entry(2 * i, f"p{i}", p, grad=False)
        store.count(e.nbytes)
        store.store(e, p.data, keep=False)
        entries.append(e)
    store.wait_writes()
    return store, entries


def _use(store, e):
    store.fetch([e], "test")
    store.unpin([e])


def test_a_read_ahead_spares_an_awaited_entry_and_a_demand_takes_it_last(tmp_path):
    store, (e0, e1, e2, e3) = _store(tmp_path, 4, 2 * MAPPED_MIN)   # room for two
    _use(store, e0)
    e0.awaited = True                    # all-gathered for the backward: its update comes next
    _use(store, e1)
    store.prefetch([e2])                 # evicts e1, not e0 (the least recently used)
    assert e0.tensor is not None and e1.tensor is None and e2.tensor is not None
    e2.read.result()                     # landed: evictable
    store.prefetch([e3])                 # no room without evicting e0 or a read ahead: none
    assert e3.tensor is None
    _use(store, e3)                      # a demand evicts the read ahead e2 before e0
    assert e0.tensor is not None and e2.tensor is None
    store.fetch([e3], "test")
    _use(store, e1)                      # e3 pinned, only e0 is left: a demand takes it
    assert e0.tensor is None and not e0.awaited and e1.tensor is not None
    store.unpin([e3])
    for e, value in ((e0, 1.0), (e3, 4.0)):
        _use(store, e)
        assert torch.equal(e.param.data, torch.full((MAPPED_MIN // 4,), value))
    store.close()
