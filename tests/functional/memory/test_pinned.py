"""Locked memory: aligned, locked, owned by the tensor, released on free and on GC."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

import deepnvme
from deepnvme.memory import pinned
from deepnvme.memory.pinned import BufferPool, locked_bytes


def vm_locked_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    raise RuntimeError("no VmLck in /proc/self/status")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float64])
def test_aligned_locked_and_typed(dtype):
    t = deepnvme.new_cpu_locked_tensor(12_345, dtype)
    assert t.dtype == dtype and t.shape == (12_345,) and t.data_ptr() % 4096 == 0
    assert deepnvme.is_pinned(t) and deepnvme.is_pinned(t[100:200]) and deepnvme.is_pinned(t.view(-1, 5))
    assert not deepnvme.is_pinned(torch.empty(10))
    t.fill_(1)
    assert float(t.float().sum()) == 12_345
    assert deepnvme.free_cpu_locked_tensor(t)


def test_example_tensor_and_zero_elements():
    t = deepnvme.new_cpu_locked_tensor(0, torch.empty(3, dtype=torch.int16))
    assert t.numel() == 0 and t.dtype == torch.int16
    with pytest.raises(ValueError):
        deepnvme.new_cpu_locked_tensor(-1, torch.float32)
    with pytest.raises(TypeError):
        deepnvme.new_cpu_locked_tensor(4, "float32")


def test_memory_is_released_on_free_and_on_gc():
    gc.collect()
    base_locked, base_vm = locked_bytes(), vm_locked_kib()
    size = 32 << 20
    t = deepnvme.new_cpu_locked_tensor(size, torch.uint8)
    assert locked_bytes() - base_locked == size
    assert vm_locked_kib() - base_vm >= size // 1024
    assert deepnvme.free_cpu_locked_tensor(t)
    assert t.numel() == 0
    assert not deepnvme.free_cpu_locked_tensor(t)  # second free: not ours any more
    gc.collect()
    assert locked_bytes() == base_locked and vm_locked_kib() - base_vm < 1024
    u = deepnvme.new_cpu_locked_tensor(size, torch.uint8)
    view = u[10:]
    del u
    gc.collect()
    assert locked_bytes() - base_locked == size  # a view keeps it alive and locked
    del view
    gc.collect()
    assert locked_bytes() == base_locked and vm_locked_kib() - base_vm < 1024


def test_views_survive_free():
    t = deepnvme.new_cpu_locked_tensor(1000, torch.float32)
    t.fill_(3)
    view = t[:10]
    assert deepnvme.free_cpu_locked_tensor(t)
    assert float(view.sum()) == 30  # still valid memory, now unlocked
    assert not deepnvme.is_pinned(view)


def test_mlock_refused_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(pinned, "_mlock", lambda address, size: 12)  # ENOMEM
    monkeypatch.setattr(pinned, "_warned_mlock", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = deepnvme.new_cpu_locked_tensor(5000, torch.float32)
        b = deepnvme.new_cpu_locked_tensor(5000, torch.float32)
    msgs = [str(w.message) for w in caught if "mlock" in str(w.message)]
    assert len(msgs) == 1 and "RLIMIT_MEMLOCK" in msgs[0]
    assert a.data_ptr() % 4096 == 0 and not deepnvme.is_pinned(a)
    a.fill_(2)
    assert deepnvme.free_cpu_locked_tensor(a) and deepnvme.free_cpu_locked_tensor(b)


def test_buffer_pool_bounds_and_reuses():
    pool = BufferPool(8192, 2)
    a, b = pool.acquire(), pool.acquire()
    assert deepnvme.is_pinned(a) and a.numel() == 8192
    with pytest.raises(TimeoutError, match="2 x 8192 bytes"):
        pool.acquire(timeout=0.05)
    pool.release(a)
    c = pool.acquire(timeout=1)
    assert c.data_ptr() == a.data_ptr()
    pool.release(b)
    pool.release(c)
    with pool.borrow() as d:
        assert d.numel() == 8192
    pool.close()
    with pytest.raises(ValueError):
        BufferPool(0, 1)


def test_free_works_for_tensors_made_under_inference_mode():
    with torch.inference_mode():
        t = deepnvme.new_cpu_locked_tensor(1000, torch.float32)
    assert deepnvme.free_cpu_locked_tensor(t) and t.numel() == 0
    u = deepnvme.new_cpu_locked_tensor(1000, torch.float32)
    with torch.inference_mode():
        assert deepnvme.free_cpu_locked_tensor(u)


def test_concurrent_alloc_free_keeps_the_registry_right():
    """Regression: mmap unmaps before its finalizer runs, so another thread can reuse the
    address; the old finalizer must not unregister the new tensor."""
    import threading
    errors = []

    def churn():
        try:
            for _ in range(400):
                t = deepnvme.new_cpu_locked_tensor(4096, torch.uint8)
                if not deepnvme.is_pinned(t):
                    errors.append("fresh locked tensor reported unpinned")
                deepnvme.free_cpu_locked_tensor(t)
                del t
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=churn) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping holding ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not pinned.huge_page_size(), reason="no transparent huge pages in this kernel")
def test_large_allocations_ask_for_huge_pages_and_small_ones_do_not():
    page = pinned.huge_page_size()
    big = deepnvme.new_cpu_locked_tensor(4 * page, torch.uint8)
    plain = deepnvme.new_cpu_locked_tensor(4 * page, torch.uint8, huge_pages=False)
    small = deepnvme.new_cpu_locked_tensor(page // 2, torch.uint8)
    try:
        assert "hg" in _vm_flags(big.data_ptr())  # MADV_HUGEPAGE accepted
        assert "lo" in _vm_flags(big.data_ptr())  # and still locked
        assert "hg" not in _vm_flags(plain.data_ptr()) and "hg" not in _vm_flags(small.data_ptr())
        big.fill_(3)
        assert int(big.sum()) == 3 * big.numel()
    finally:
        for t in (big, plain, small):
            deepnvme.free_cpu_locked_tensor(t)


def test_huge_page_mode_reads_the_system_setting(monkeypatch, tmp_path):
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    monkeypatch.setattr(pinned, "_THP", str(tmp_path))
    assert pinned.huge_page_mode() == "madvise"
    (tmp_path / "enabled").unlink()
    assert pinned.huge_page_mode() == "unavailable"
