"""Buffer reuse in the offload's store: mappings of >= 1 MiB go back to a free list once their I/O
ended and nothing else uses them, and training that reuses them still equals training in memory
bitwise; a buffer still being written, or still viewed by someone, is never handed out."""

import copy
import threading
import time
from concurrent.futures import Future

import torch
from torch import nn

import deepnvme
from deepnvme.memory.heap import MAPPED_MIN
from deepnvme.offload import offload_parameters
from deepnvme.offload._entry import Entry
from deepnvme.offload._store import TensorStore

DIM = 512  # a 512 x 512 fp32 weight is 1 MiB = MAPPED_MIN: reused


def test_training_that_reuses_buffers_equals_training_in_memory_bitwise(tmp_path):
    torch.manual_seed(0)
    a = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(4)])
    b = copy.deepcopy(a)
    data = [torch.randn(8, DIM, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    ref = torch.optim.AdamW(a.parameters(), lr=1e-2)
    for x in data:
        ref.zero_grad()
        a(x).pow(2).mean().backward()
        ref.step()
    budget = 3 * MAPPED_MIN + 3 * 4 * DIM    # three weights (and biases) of the four
    off = offload_parameters(b, tmp_path, max_in_memory_bytes=budget, prefetch=1)
    opt = deepnvme.NVMeOptimizer(b.parameters(), torch.optim.AdamW, swap_dir=tmp_path,
                                 sub_group_bytes=MAPPED_MIN, lr=1e-2)
    for x in data:
        opt.zero_grad()
        b(x).pow(2).mean().backward()
        opt.step()
    got = off.state_dict()
    for name, value in a.state_dict().items():
        assert torch.equal(value, got[name]), name
    stats = off.stats()
    assert stats.buffers_reused > 0
    assert stats.peak_bytes <= budget + MAPPED_MIN + 4 * DIM   # + autograd's gradient
    off.close()
    opt.close()


def _store_with_two(tmp_path, budget, *, grad=False):
    store = TensorStore(tmp_path, budget=budget, config=None)
    entries = []
    for i in range(2):
        p = nn.Parameter(torch.full((MAPPED_MIN // 4,), float(i + 1)))
        e = Entry(2 * i + grad, f"p{i}", p, grad=grad)
        store.count(e.nbytes)
        store.store(e, p.data, keep=False)
        entries.append(e)
    store.wait_writes()
    return store, entries


def test_a_buffer_is_not_reused_while_its_write_runs(tmp_path):
    # gradients: an accumulated one is written from its present tensor, which then leaves
    store, (e0, e1) = _store_with_two(tmp_path, MAPPED_MIN, grad=True)   # room for one tensor
    store.fetch([e0], "test")
    e0.tensor.fill_(7.0)
    first = e0.tensor.data_ptr()
    gate, real = Future(), store.swapper.swap_out
    opened = threading.Event()

    def held_back(key, tensor):
        write = real(key, tensor)

        def open_later():
            time.sleep(0.3)
            write.result()
            opened.set()
            gate.set_result(None)
        threading.Thread(target=open_later).start()
        return gate               # the write "runs" until the gate opens

    store.swapper.swap_out = held_back
    store.unpin([e0])
    store.store(e0, e0.tensor, keep=False)   # leaves the entry; its buffer stays with the write
    store.swapper.swap_out = real
    assert store.free_bytes == 0 and not opened.is_set()
    store.fetch([e1], "test")                # needs e0's memory: waits for the write, then reuses
    assert opened.is_set()
    assert store.reused == 1 and e1.tensor.data_ptr() == first
    assert torch.equal(e1.tensor, torch.full_like(e1.tensor, 2.0))
    store.unpin([e1])
    store.fetch([e0], "test")                # e1 evicted, its buffer reused: e0 reads its file
    assert store.reused == 2 and e0.tensor.data_ptr() == first
    assert torch.equal(e0.tensor, torch.full_like(e0.tensor, 7.0))
    store.close()


def test_a_buffer_still_viewed_is_not_reused(tmp_path):
    store, (e0, e1) = _store_with_two(tmp_path, 2 * MAPPED_MIN)   # room for both
    store.fetch([e0], "test")
    view = e0.tensor[:4]                     # e.g. a tensor autograd or the user still holds
    store.unpin([e0])
    held = store.held
    store.drop(e0)
    assert store.free_bytes == 0 and store.held == held - e0.nbytes   # unmapped with the view
    store.fetch([e1], "test")
    assert e1.tensor.data_ptr() != view.data_ptr()
    assert torch.equal(view, torch.ones(4))
    store.unpin([e1])
    store.drop(e1)                           # unshared: kept, counted, then reused
    assert store.free_bytes == e1.nbytes and store.held == held
    store.fetch([e0], "test")
    assert store.reused == 1 and store.free_bytes == 0
    assert torch.equal(e0.tensor, torch.ones_like(e0.tensor)) and torch.equal(view, torch.ones(4))
    store.close()


def test_gradients_are_written_from_reused_buffers_within_the_budget(tmp_path, monkeypatch):
    # after the first step, gradients map (almost) no new memory of >= MAPPED_MIN: each is copied
    # into the buffer of a parameter evicted for it, and held bytes stay within the budget
    import deepnvme.offload._entry as entry_module
    import deepnvme.offload._gradients as gradients
    import deepnvme.offload._store as store_module

    mapped = []

    def counting(real):
        def mapped_empty(nbytes):
            if nbytes >= MAPPED_MIN:
                mapped.append(nbytes)
            return real(nbytes)
        return mapped_empty

    monkeypatch.setattr(entry_module, "mapped_empty", counting(entry_module.mapped_empty))
    monkeypatch.setattr(store_module, "mapped_empty", counting(store_module.mapped_empty))
    monkeypatch.setattr(gradients, "mapped_empty", counting(gradients.mapped_empty))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(DIM, DIM) for _ in range(4)])
    budget = 3 * MAPPED_MIN + 3 * 4 * DIM
    off = offload_parameters(model, tmp_path, max_in_memory_bytes=budget, prefetch=1)
    opt = deepnvme.NVMeOptimizer(model.parameters(), torch.optim.SGD, swap_dir=tmp_path,
                                 sub_group_bytes=MAPPED_MIN, lr=1e-2, fuse_backward=False)  # grads written
    x = torch.randn(8, DIM)
    for step in range(3):
        if step == 1:
            mapped.clear()
            off.reset_stats()
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    stats = off.stats()
    # before the reuse every gradient got a mapping (8 in these two steps); now usually one per
    # step: a parameter evicted while autograd still views it is unmapped (not reused) and its
    # gradient gets a new mapping. How often that happens depends on when the prefetch thread
    # runs: 3 seen in CI under load (1 run in ~20), so the bound is half of the 8
    assert len(mapped) <= 4, mapped
    assert stats.buffers_reused >= 4 * 4       # per step: 4 weights x (2 reads, grad, update read)
    # + one gradient, as documented: one that autograd happened to allocate page-aligned is
    # written from its own tensor, counted before room is made (seen: 2048 B, a bias, 1 run in ~10)
    assert stats.peak_bytes <= budget + MAPPED_MIN
    off.close()
    opt.close()


def test_a_demand_waits_for_a_prefetch_in_flight_instead_of_failing(tmp_path):
    """Room held only by a prefetch whose read is still running: a demand waits for it to
    land and evicts it (it raised OffloadMemoryError before)."""
    store, (e0, e1) = _store_with_two(tmp_path, MAPPED_MIN)   # room for one tensor
    gate, real = Future(), store.swapper.swap_in
    landed = threading.Event()

    def slow_read(key, out=None):
        read = real(key, out=out)

        def land_later():
            time.sleep(0.3)
            read.result()
            landed.set()
            gate.set_result(out)
        threading.Thread(target=land_later).start()
        return gate

    store.swapper.swap_in = slow_read
    store.prefetch([e0])                    # takes the whole budget, read in flight
    store.swapper.swap_in = real
    assert e0.tensor is not None and not landed.is_set()
    store.fetch([e1], "test")               # waits for e0's read, drops e0, reads e1
    assert landed.is_set() and e0.tensor is None
    assert torch.equal(e1.tensor, torch.full_like(e1.tensor, 2.0))
    assert store.held <= store.budget
    store.unpin([e1])
    store.close()
