"""io_uring registered buffers: locked allocations are registered on first use, transfers use
them, and a freed allocation's registration is dropped (a new one at the same address must
never reach the old pages)."""

from __future__ import annotations

import gc

import pytest
import torch

import deepnvme
from deepnvme.io import uring
from deepnvme.io import uring_share as share
from deepnvme.memory import pinned

from ...conftest import AVAILABLE_ENGINES, random_tensor, same_bytes

ENGINE_SPECIFIC = True
pytestmark = pytest.mark.skipif("io_uring" not in AVAILABLE_ENGINES, reason="no io_uring here")


@pytest.fixture
def slots(monkeypatch):
    """Every fixed_slot answer, as (address, length, slot)."""
    seen = []
    real = uring.UringQueue.fixed_slot

    def recording(self, address, length):
        slot = real(self, address, length)
        seen.append((address, length, slot))
        return slot

    monkeypatch.setattr(uring.UringQueue, "fixed_slot", recording)
    return seen


def test_locked_buffers_are_registered_and_used(tmp_path, slots):
    path = str(tmp_path / "f")
    data = random_tensor(4 << 20, torch.uint8)
    with deepnvme.AioHandle(block_size=1 << 20, engine="io_uring") as h:
        locked = deepnvme.new_cpu_locked_tensor(4 << 20, torch.uint8)
        locked.copy_(data)
        h.sync_pwrite(locked, path)
        back = deepnvme.new_cpu_locked_tensor(4 << 20, torch.uint8)
        h.sync_pread(back, path)
        assert same_bytes(back, data)
        plain = torch.empty(4 << 20, dtype=torch.uint8)
        h.sync_pread(plain, path)
        assert same_bytes(plain, data)

    def inside(t, a):
        return t.data_ptr() <= a < t.data_ptr() + t.nbytes

    # 4 chunks written from `locked`, 4 read into `back`, all through registered slots
    assert sorted(s >= 0 for a, n, s in slots if inside(locked, a) or inside(back, a)) == [True] * 8
    # `plain` is not locked memory: never registered. Its chunks go through locked bounce
    # buffers (which are) when it is not page-aligned; torch.empty happens to return a
    # page-aligned address now and then (1 in 64 here), and then they go straight to it and are
    # asked for a slot, which must be refused
    assert all(s < 0 for a, n, s in slots if inside(plain, a))


def test_a_freed_allocation_is_unregistered_and_its_address_reused_safely(tmp_path, slots):
    path_a, path_b = str(tmp_path / "a"), str(tmp_path / "b")
    a_data, b_data = random_tensor(1 << 20, torch.uint8, seed=1), random_tensor(1 << 20, torch.uint8, seed=2)
    with deepnvme.AioHandle(block_size=1 << 20, engine="io_uring") as h:
        h.sync_pwrite(a_data, path_a)
        h.sync_pwrite(b_data, path_b)
        buf = deepnvme.new_cpu_locked_tensor(1 << 20, torch.uint8)
        h.sync_pread(buf, path_a)
        first = buf.untyped_storage().data_ptr()
        assert same_bytes(buf, a_data) and slots[-1][2] >= 0
        released = []
        real = uring.UringQueue.region_released

        def watch(self, region):
            released.append(region)
            real(self, region)

        uring.UringQueue.region_released = watch
        try:
            del buf
            gc.collect()
            assert released, "freeing the allocation must drop its registration"
        finally:
            uring.UringQueue.region_released = real
        for _ in range(20):  # try to get the same address back
            again = deepnvme.new_cpu_locked_tensor(1 << 20, torch.uint8)
            if again.untyped_storage().data_ptr() == first:
                break
        h.sync_pread(again, path_b)
        assert same_bytes(again, b_data)


def test_locked_region_lookup():
    t = deepnvme.new_cpu_locked_tensor(3 * 4096, torch.uint8)
    base = t.untyped_storage().data_ptr()
    region, found_base, size = pinned.locked_region(base + 4096, 4096)
    assert found_base == base and size == 3 * 4096
    assert pinned.locked_region(base + 2 * 4096, 2 * 4096) is None  # runs past its end


def test_a_release_during_a_registration_on_the_same_thread_does_not_deadlock(tmp_path, monkeypatch):
    """Regression: the garbage collector can free a registered allocation (and so call
    region_released) inside fixed_slot's own registration call; a plain lock deadlocked."""
    from ...concurrency import call_in_thread

    path = str(tmp_path / "f")
    data = random_tensor(1 << 20, torch.uint8)
    h = deepnvme.AioHandle(block_size=1 << 20, engine="io_uring")
    if True:  # no `with`: after a deadlock, close() would hang the suite instead of failing
        h.sync_pwrite(data, path)
        old = deepnvme.new_cpu_locked_tensor(1 << 20, torch.uint8)
        h.sync_pread(old, path)  # registers `old`
        victim = [old.untyped_storage().data_ptr()]
        del old
        real = uring.UringQueue._set_slot
        fired = []

        def set_slot_with_a_release(self, slot, base, size):
            if size and not fired:  # as if the GC ran a finalizer right here
                fired.append(True)
                gc.collect()
                for region, slot_ in list((self._fixed or {}).items()):
                    self.region_released(region)
            real(self, slot, base, size)

        monkeypatch.setattr(uring.UringQueue, "_set_slot", set_slot_with_a_release)
        new = deepnvme.new_cpu_locked_tensor(2 << 20, torch.uint8)

        def read():
            h.sync_pread(new[: 1 << 20], path)
            return True

        assert call_in_thread(read, 30, "a release inside a registration deadlocked") is True
        assert fired and same_bytes(new[: 1 << 20], data) and victim
    h.close()


def test_a_second_ring_clones_the_registration_instead_of_pinning_again(tmp_path, monkeypatch):
    """One ring per worker, each used by a thread of its own (as workers are): the allocation is
    pinned once, by the source ring of .uring_share, and every ring clones its registration
    (where the kernel clones one slot, Linux 6.13+) and reads through it. Regression: cloned from
    another worker's single-issuer ring, enabled by another thread, the kernel refused (EEXIST)
    and each ring pinned the allocation itself."""
    import os

    from ...concurrency import call_in_thread

    pinned_here, cloned = [], []
    real_set, real_register = uring.UringQueue._set_slot, uring.UringQueue._register

    def set_slot(self, slot, base, size):
        pinned_here.append(size)
        real_set(self, slot, base, size)

    def register(self, opcode, arg, nr):
        real_register(self, opcode, arg, nr)
        if opcode == uring._REGISTER_CLONE_BUFFERS:
            cloned.append(self)

    monkeypatch.setattr(uring.UringQueue, "_set_slot", set_slot)
    monkeypatch.setattr(uring.UringQueue, "_register", register)
    data = random_tensor(4 << 20, torch.uint8)
    path = str(tmp_path / "f")
    with deepnvme.AioHandle(block_size=1 << 20, engine="threads") as h:
        h.sync_pwrite(data, path)
    buf = deepnvme.new_cpu_locked_tensor(4 << 20, torch.uint8)
    rings = [uring.UringQueue(4) for _ in range(3)]
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    try:
        base = buf.data_ptr()  # the closures hold the address only: buf is freed below
        for i, q in enumerate(rings):
            def first_use(i=i, q=q, base=base):
                slot = q.fixed_slot(base + (i << 20), 1 << 20)
                assert slot >= 0
                q.prep(7, False, fd, base + (i << 20), 1 << 20, i << 20, slot)
                return q.submit_and_wait(1)
            assert call_in_thread(first_use, 30, "a ring's first read hung") == [(7, 1 << 20)]
        if not share._clones[0]:
            pytest.skip("this kernel cannot clone one registered slot: each ring pins")
        assert pinned_here == [buf.nbytes] and cloned == rings
        assert same_bytes(buf[: 3 << 20], data[: 3 << 20])
    finally:
        os.close(fd)
        for q in rings:
            q.close()
    region = pinned.locked_region(buf.data_ptr(), 1)[0]
    assert not set(uring._holders.get(region, ())) & set(rings)
    if not share._rings[0]:
        assert not share._source  # closed with the last worker ring (others may be open in a suite)
    del buf
    gc.collect()
    share.tidy_source()  # a release that found the lock taken is dropped here (or by an idle worker)
    assert region not in uring._holders  # the source, if still open, dropped the freed allocation


def test_a_release_never_waits_for_a_ring_lock_held_elsewhere(tmp_path):
    """Regression (a deadlock seen in the suite): a finalizer freed a registered allocation
    inside ring X's registration, on a thread holding ``_holders_lock``, and waited for ring Y's
    lock, held by a thread waiting for ``_holders_lock``. region_released must not wait: the
    region is dropped at the ring's next fixed_slot instead."""
    import threading

    from ...concurrency import call_in_thread

    path = str(tmp_path / "f")
    data = random_tensor(1 << 20, torch.uint8)
    h = deepnvme.AioHandle(block_size=1 << 20, engine="io_uring")
    h.sync_pwrite(data, path)
    old = deepnvme.new_cpu_locked_tensor(1 << 20, torch.uint8)
    h.sync_pread(old, path)  # registers `old` in the worker's ring
    found = pinned.locked_region(old.data_ptr(), 1)
    assert found is not None
    region = found[0]
    rings = [r for r in pinned._release_listeners
             if isinstance(r, uring.UringQueue) and not r.plain and region in (r._fixed or {})]
    assert len(rings) == 1, "the handle's one ring registered the locked buffer"
    ring = rings[0]
    holding, done = threading.Event(), threading.Event()

    def hold():
        with ring._fixed_lock:
            holding.set()
            done.wait(30)

    holder = threading.Thread(target=hold)
    holder.start()
    holding.wait(10)
    with uring._holders_lock:
        assert call_in_thread(lambda: ring.region_released(region) or True, 10,
                              "region_released waited for a ring lock held by another thread") is True
    assert region in ring._fixed  # deferred, not dropped
    done.set()
    holder.join(10)
    new = deepnvme.new_cpu_locked_tensor(1 << 20, torch.uint8)
    h.sync_pread(new, path)  # the next fixed_slot drops the released region first
    assert region not in ring._fixed and same_bytes(new, data)
    h.close()
    del old


def test_a_free_on_another_thread_is_dropped_by_the_idle_worker(tmp_path):
    """A single-issuer ring (Linux 6.1+) refuses registrations from any thread but its worker's
    (EEXIST): an allocation freed on the caller's thread is dropped by the worker itself, within
    about a second while it idles, and the next transfers stay correct."""
    import time

    path = str(tmp_path / "f")
    data = random_tensor(1 << 20, torch.uint8)
    with deepnvme.AioHandle(block_size=1 << 20, engine="io_uring") as h:
        h.sync_pwrite(data, path)
        buf = deepnvme.new_cpu_locked_tensor(1 << 20, torch.uint8)
        h.sync_pread(buf, path)  # registers `buf` in the worker's ring
        region = pinned.locked_region(buf.data_ptr(), 1)[0]
        rings = [r for r in pinned._release_listeners
                 if isinstance(r, uring.UringQueue) and not r.plain and region in (r._fixed or {})]
        assert len(rings) == 1
        if not rings[0].single_issuer:
            pytest.skip("this kernel's io_uring has no single-issuer rings")
        del buf
        gc.collect()  # freed here, on the caller's thread
        deadline = time.monotonic() + 10
        while region in rings[0]._fixed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert region not in rings[0]._fixed, "the idle worker must drop the freed allocation"
        assert region not in uring._holders  # the source ring dropped it too
        again = deepnvme.new_cpu_locked_tensor(1 << 20, torch.uint8)
        h.sync_pread(again, path)
        assert same_bytes(again, data)


@pytest.mark.parametrize("why", ["no clones", "no source slot"])
def test_without_a_shared_registration_each_ring_registers_the_buffer_itself(tmp_path, monkeypatch, why):
    """Where the kernel cannot clone (before Linux 6.13) or the source ring has no free slot,
    a ring registers the allocation on its own and reads through it (regression: that path
    called a method the ring does not have, failing the read)."""
    path = str(tmp_path / "f")
    data = random_tensor(1 << 20, torch.uint8)
    if why == "no clones":
        monkeypatch.setattr(share, "_clones", [False])
    else:
        monkeypatch.setattr(uring.UringQueue, "fixed_slot_at", lambda self, region, base, size: -1)
    with deepnvme.AioHandle(block_size=1 << 20, engine="io_uring") as h:
        h.sync_pwrite(data, path)
        buf = deepnvme.new_cpu_locked_tensor(1 << 20, torch.uint8)
        h.sync_pread(buf, path)
        assert same_bytes(buf, data)
        region = pinned.locked_region(buf.data_ptr(), 1)[0]
        assert [r.plain for r in uring._holders[region]] == [False]
