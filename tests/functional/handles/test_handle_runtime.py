"""Runtime behaviour of handles: GIL release, thread safety, no fd leaks, argument errors."""

from __future__ import annotations

import os
import sys
import threading
import weakref

import pytest
import torch

import deepnvme
from deepnvme.errors import DeepNVMeIOError, UnsupportedBufferError

from ...conftest import open_fds, random_tensor, same_bytes


def test_blocking_calls_release_the_gil(tmp_path):
    """With a 60 s switch interval a peer thread only runs when the caller gives the GIL away."""
    data = random_tensor(48 << 20, torch.uint8)
    path = str(tmp_path / "big")
    h = deepnvme.AioHandle(block_size=1 << 20, intra_op_parallelism=2)
    h.sync_pwrite(data, path)
    ticks = [0]
    stop, started = threading.Event(), threading.Event()

    def peer():
        started.set()
        while not stop.is_set():
            ticks[0] += 1
            stop.wait(0.0002)  # blocks briefly, so the peer never hogs the GIL itself

    old = sys.getswitchinterval()
    sys.setswitchinterval(60)
    try:
        th = threading.Thread(target=peer)
        th.start()
        started.wait()
        before = ticks[0]
        for _ in range(3):
            h.sync_pread(data, path)
            h.sync_pwrite(data, path)
        during = ticks[0] - before
        stop.set()
        th.join()
    finally:
        sys.setswitchinterval(old)
        h.close()
    assert during >= 10, f"peer thread ran only {during} times during blocking I/O"


def test_shared_handle_across_threads_no_deadlock(tmp_path):
    h = deepnvme.AioHandle(block_size=16384, queue_depth=4, intra_op_parallelism=2)
    ref = random_tensor(1 << 20, torch.uint8)
    path = str(tmp_path / "shared")
    h.sync_pwrite(ref, path)
    errors: list[BaseException] = []

    def reader(seed: int):
        try:
            for i in range(30):
                off = (seed * 7919 + i * 104729) % (len(ref) - 5000)
                out = torch.empty(5000, dtype=torch.uint8)
                h.sync_pread(out, path, off)
                assert torch.equal(out, ref[off:off + 5000])
        except BaseException as exc:  # collected and re-raised by the main thread
            errors.append(exc)

    def allocator():
        try:
            for _ in range(50):
                t = h.new_cpu_locked_tensor(10_000, torch.float32)
                assert h.is_pinned(t)
                assert h.free_cpu_locked_tensor(t)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=allocator) for _ in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not any(th.is_alive() for th in threads), "deadlock: threads still running"
    assert not errors, errors
    h.close()


def test_async_ops_from_many_threads_counted_by_one_wait(tmp_path):
    h = deepnvme.AioHandle(block_size=8192, intra_op_parallelism=3)
    t = random_tensor(30_000, torch.uint8)

    def submit(i):
        for j in range(5):
            h.async_pwrite(t, str(tmp_path / f"{i}-{j}"))

    threads = [threading.Thread(target=submit, args=(i,)) for i in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert h.wait() == 20
    h.close()


def test_no_fd_leaks_over_hundreds_of_ops(tmp_path):
    h = deepnvme.AioHandle(block_size=4096, intra_op_parallelism=2)
    t = random_tensor(10_001, torch.uint8)
    path = str(tmp_path / "f")
    h.sync_pwrite(t, path)
    before = open_fds()
    for i in range(150):
        h.sync_pwrite(t, path, i)
        h.async_pread(torch.empty(5000, dtype=torch.uint8), path, i)
        with pytest.raises(DeepNVMeIOError):
            h.sync_pread(t, str(tmp_path / "missing"))
    assert h.wait() == 150
    with pytest.raises(DeepNVMeIOError):
        h.sync_pread(torch.empty(1 << 20, dtype=torch.uint8), path)  # past EOF
    assert open_fds() == before
    h.close()


def test_writes_never_truncate(tmp_path, handle):
    path = str(tmp_path / "f")
    big = random_tensor(100_000, torch.uint8)
    handle.sync_pwrite(big, path)
    small = torch.zeros(10, dtype=torch.uint8)
    handle.sync_pwrite(small, path, 500)
    assert os.path.getsize(path) == 100_000
    expected = big.clone()
    expected[500:510] = 0
    back = torch.empty_like(big)
    handle.sync_pread(back, path)
    assert torch.equal(back, expected)


def test_write_to_fd_does_not_close_it(tmp_path, handle):
    fd = os.open(str(tmp_path / "f"), os.O_RDWR | os.O_CREAT)
    try:
        handle.async_pwrite(random_tensor(9000, torch.uint8), fd, 0)
        assert handle.wait() == 1
        os.fstat(fd)  # still open
        direct = os.open(str(tmp_path / "g"), os.O_RDWR | os.O_CREAT | os.O_DIRECT)
        t = random_tensor(12_345, torch.uint8)
        handle.async_pwrite(t, direct, 3)  # unaligned over an O_DIRECT fd
        assert handle.wait() == 1
        os.close(direct)
        with open(tmp_path / "g", "rb") as f:
            assert f.read()[3:] == t.numpy().tobytes()
    finally:
        os.close(fd)


def test_bad_buffers_get_clear_errors(tmp_path, handle):
    path = str(tmp_path / "f")
    with pytest.raises(UnsupportedBufferError, match="not contiguous"):
        handle.sync_pwrite(torch.zeros(4, 4).t(), path)
    with pytest.raises(UnsupportedBufferError, match="device meta"):
        handle.sync_pwrite(torch.empty(4, device="meta"), path)
    with pytest.raises(UnsupportedBufferError, match="torch.Tensor"):
        handle.sync_pwrite(b"bytes", path)
    with pytest.raises(DeepNVMeIOError, match="negative file offset"):
        handle.sync_pwrite(torch.zeros(4), path, -1)
    with pytest.raises(TypeError):
        handle.sync_pwrite(torch.zeros(4), 3.5)
    with pytest.raises(TypeError):
        handle.sync_pwrite(torch.zeros(4), None)


def test_read_requires_exact_size(tmp_path, handle):
    path = str(tmp_path / "f")
    handle.sync_pwrite(torch.zeros(100, dtype=torch.uint8), path)
    with pytest.raises(DeepNVMeIOError, match="buffer has 50 bytes but the file holds 100"):
        handle.read(torch.empty(50, dtype=torch.uint8), path, False)
    assert handle.read(torch.empty(60, dtype=torch.uint8), path, False, 40) == 0


def test_pathlike_targets(tmp_path, handle):
    t = random_tensor(1000, torch.uint8)
    assert handle.sync_pwrite(t, tmp_path / "p") == 1
    back = torch.empty_like(t)
    assert handle.sync_pread(back, tmp_path / "p") == 1 and same_bytes(back, t)


def test_context_manager_waits_and_close_is_idempotent(tmp_path):
    t = random_tensor(1 << 20, torch.uint8)
    with deepnvme.AioHandle(intra_op_parallelism=2) as h:
        for i in range(4):
            h.async_pwrite(t, str(tmp_path / f"c{i}"))
    assert all(os.path.getsize(tmp_path / f"c{i}") == t.numel() for i in range(4))
    h.close()
    h.close()


def test_close_logs_unwaited_failures(tmp_path, caplog):
    h = deepnvme.AioHandle()
    h.async_pread(torch.empty(10), str(tmp_path / "missing"))
    with caplog.at_level("ERROR", logger="deepnvme"):
        h.close()
    assert any("never waited for" in r.message for r in caplog.records)


def test_from_deepspeed_config():
    h = deepnvme.AioHandle.from_config({"aio": {"block_size": 131072, "queue_depth": 16,
                                                "thread_count": 2, "single_submit": False,
                                                "overlap_events": False, "use_gds": False}})
    assert (h.get_block_size(), h.get_queue_depth(), h.get_intra_op_parallelism()) == (131072, 16, 2)
    h.close()


def test_import_starts_no_threads():
    code = ("import threading, deepnvme; import deepnvme.compat; "
            "assert threading.active_count() == 1, threading.enumerate(); "
            "h = deepnvme.AioHandle(intra_op_parallelism=3); assert threading.active_count() == 1")
    import subprocess
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bounce_buffers_cover_chunks_longer_than_block_size(tmp_path):
    """Regression: block_size 512 plans 4096-byte direct chunks; bounce buffers must fit them."""
    h = deepnvme.AioHandle(block_size=512, intra_op_parallelism=1)
    src = random_tensor(6143 + 1, torch.uint8)[1:]  # misaligned address -> bounce
    path = str(tmp_path / "f")
    for _ in range(5):
        h.sync_pwrite(src, path)
        back = torch.empty(6143 + 5, dtype=torch.uint8)[5:]
        h.sync_pread(back, path)
        assert torch.equal(back, src)
    h.close()


def test_closed_handle_refuses_work(tmp_path):
    h = deepnvme.AioHandle()
    h.close()
    before = open_fds()
    with pytest.raises(RuntimeError, match="closed"):
        h.sync_pwrite(torch.zeros(4), str(tmp_path / "f"))
    assert open_fds() == before


def test_close_racing_a_submit_refuses_the_submit(tmp_path, monkeypatch):
    """Regression: close() used to drain before refusing new work, so an op admitted during
    the drain hung (its chunks went to stopped workers) or restarted workers nobody stopped."""
    from deepnvme.io.workers import WorkerGroup
    h = deepnvme.AioHandle(intra_op_parallelism=2)
    h.sync_pwrite(torch.zeros(10), str(tmp_path / "a"))
    seen = []
    original = WorkerGroup.drain
    # a weak reference: a closure holding the handle would free it (running __del__) while
    # monkeypatch swaps the class attribute back, which CPython's method cache does not survive
    handle_ref = weakref.ref(h)

    def drain_then_submit(self):
        try:
            handle_ref().sync_pwrite(torch.zeros(10), str(tmp_path / "b"))
            seen.append("admitted")
        except RuntimeError as exc:
            seen.append(str(exc))
        original(self)

    monkeypatch.setattr(WorkerGroup, "drain", drain_then_submit)
    before = open_fds()
    workers = list(h._engine._window.workers.threads)
    assert workers
    h.close()
    assert seen and "closed" in seen[0]
    assert not any(t.is_alive() for t in workers) and not h._engine._window.workers.threads
    assert open_fds() == before


def test_close_from_a_done_callback_is_refused_not_a_deadlock(tmp_path):
    h = deepnvme.AioHandle(intra_op_parallelism=1)
    errors = []

    def close_here(_fut):
        try:
            h.close()
        except RuntimeError as exc:
            errors.append(exc)

    f1 = h.submit_write(random_tensor(1 << 20, torch.uint8), str(tmp_path / "a"))
    f1.add_done_callback(close_here)
    f2 = h.submit_write(random_tensor(1 << 20, torch.uint8), str(tmp_path / "b"))
    assert f2.result(timeout=30) == 1 << 20
    f1.result(timeout=30)
    assert errors and "own worker thread" in str(errors[0])
    h.close()


def test_bool_is_not_a_file_descriptor(tmp_path, handle):
    with pytest.raises(TypeError, match="bool"):
        handle.sync_pwrite(torch.zeros(4), True)
