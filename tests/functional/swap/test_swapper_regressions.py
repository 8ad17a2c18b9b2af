"""TensorSwapper regressions: buffer bookkeeping under deferred releases, failed writes and races."""

import errno
import os
import threading
import time

import pytest
import torch

import deepnvme
from deepnvme.io.posix import Posix
from deepnvme.swap import SwapBufferError, TensorSwapper

from ...concurrency import call_in_thread


class SlowDisk(Posix):
    """Writes sleep ``delay`` s first (GIL released); with ``fail`` set they then raise ENOSPC."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.fail = False

    def pwritev(self, fd, buffers, offset):
        if self.delay:
            time.sleep(self.delay)
        if self.fail:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwritev(fd, buffers, offset)


def test_waiter_wakes_when_the_pending_release_turns_into_a_kept_buffer(tmp_path):
    """A buffer request waiting for a release deferred behind a write must not sleep forever when
    that write fails (the buffer is then kept): it raises SwapBufferError."""
    disk = SlowDisk()
    s = TensorSwapper(tmp_path, buffer_bytes=1 << 16, buffer_count=1, min_swap_bytes=0,
                      handle=deepnvme.AioHandle(posix=disk))
    s.swap_out("a", torch.ones(1000)).result()
    s.swap_out("b", torch.ones(1000)).result()
    buf = s.swap_in("a").result()             # the only pool buffer
    disk.delay, disk.fail = 0.3, True
    fut = s.swap_out("a", buf)                 # zero-copy write from the buffer; will fail
    s.release("a")                             # deferred behind the write
    got = call_in_thread(lambda: s.swap_in("b"), 5,
                         "swap_in('b') hangs after the write it waited for failed")
    assert isinstance(fut.exception(), OSError)
    assert isinstance(got, SwapBufferError)
    assert torch.equal(s.swap_in("a").result(), torch.ones(1000))   # the kept data
    disk.delay, disk.fail = 0.0, False
    s.release("a", force=True)
    s.close()


def test_swap_in_cancels_a_pending_release(tmp_path):
    """swap_in of a key whose release is deferred behind a write hands out its buffer: the release
    must be called off, or the buffer goes back to the pool while the caller uses it."""
    disk = SlowDisk(0.2)
    with TensorSwapper(tmp_path, buffer_bytes=4096, buffer_count=1, min_swap_bytes=0,
                       handle=deepnvme.AioHandle(posix=disk)) as s:
        s.swap_out("other", torch.full((16,), 9.0)).result()
        buf = s.new_buffer("k", (16,), torch.float32)
        buf.fill_(1.0)
        fut = s.swap_out("k", buf)
        s.release("k")                     # deferred: the write is in flight
        v = s.swap_in("k").result()        # held again
        fut.result()
        s.wait()
        assert s.buffers_in_use() == 1 and s.held_buffer("k") is not None
        disk.delay = 0.0
        try:
            w = s.swap_in("other").result()
        except SwapBufferError:
            w = None                       # right: the only buffer is k's
        assert w is None or w.data_ptr() != v.data_ptr()
        assert v.tolist() == [1.0] * 16
        s.release("k")
        assert s.buffers_in_use() == 0


def test_swap_out_from_another_tensor_makes_the_held_buffer_stale(tmp_path):
    with TensorSwapper(tmp_path, buffer_bytes=4096, buffer_count=2, min_swap_bytes=0) as s:
        s.swap_out("k", torch.full((16,), 1.0)).result()
        s.swap_in("k").result()                                  # k holds a buffer with 1.0
        s.swap_out("k", torch.full((16,), 2.0)).result()         # new value, another tensor
        assert s.swap_in("k").result().tolist() == [2.0] * 16
        s.release("k")
        assert s.swap_in("k").result().tolist() == [2.0] * 16


def test_swap_out_of_a_view_at_an_offset_of_the_buffer_is_read_back(tmp_path):
    with TensorSwapper(tmp_path, buffer_bytes=4096, buffer_count=2, min_swap_bytes=0) as s:
        buf = s.new_buffer("k", (16,), torch.float32)
        buf.copy_(torch.arange(16.0))
        s.swap_out("k", buf[4:]).result()
        assert s.swap_in("k").result().tolist() == torch.arange(4.0, 16.0).tolist()
        s.release("k")
        assert s.swap_in("k").result().tolist() == torch.arange(4.0, 16.0).tolist()
        # the buffer itself (offset 0, a prefix) is still written without a read back
        s.release("k")
        buf = s.new_buffer("j", (16,), torch.float32)
        buf.copy_(torch.arange(16.0))
        s.swap_out("j", buf[:8]).result()
        got = s.swap_in("j").result()
        assert got.data_ptr() == buf.data_ptr() and got.tolist() == torch.arange(8.0).tolist()


def test_read_result_keeps_the_shape_of_its_submission(tmp_path):
    """A swap_out queued after a swap_in (ops on a key run in order) must not change the shape or
    dtype of that swap_in's result."""
    disk = SlowDisk(0.05)
    with TensorSwapper(tmp_path, buffer_bytes=1 << 16, buffer_count=2, min_swap_bytes=0,
                       handle=deepnvme.AioHandle(posix=disk)) as s:
        s.swap_out("k", torch.arange(1024, dtype=torch.float32))    # slow, not waited
        f = s.swap_in("k")                                           # queued after the write
        s.swap_out("k", torch.zeros(4, dtype=torch.float64))         # queued after the read
        t = f.result()
        assert tuple(t.shape) == (1024,) and t.dtype == torch.float32
        assert torch.equal(t, torch.arange(1024, dtype=torch.float32))
        s.wait()
        assert s.swap_in("k").result().tolist() == [0.0] * 4


def test_concurrent_swap_in_of_one_key_takes_one_buffer(tmp_path):
    with TensorSwapper(tmp_path, buffer_bytes=1 << 16, buffer_count=8, min_swap_bytes=0,
                       acquire_timeout=0.5) as s:
        s.swap_out("k", torch.arange(1000.0)).result()
        acquire = s._lender._pool.acquire

        def slow_acquire(*a, **kw):       # widen the window between the check and the set
            time.sleep(0.02)
            return acquire(*a, **kw)

        s._lender._pool.acquire = slow_acquire
        for _ in range(5):
            barrier = threading.Barrier(2)
            results = []

            def go():
                barrier.wait()
                results.append(s.swap_in("k").result())

            ts = [threading.Thread(target=go) for _ in range(2)]
            for t in ts:
                t.start()
            for t in ts:
                t.join(5)
            assert [r.tolist() for r in results] == [torch.arange(1000.0).tolist()] * 2
            assert results[0].data_ptr() == results[1].data_ptr()
            assert s.buffers_in_use() == 1
            s.release("k")
            s.wait()
            assert s.buffers_in_use() == 0


def test_swap_in_after_a_new_value_reads_into_a_fresh_buffer(tmp_path):
    """new_buffer(k), swap_out(k, other), swap_in(k): the read must not land in the new_buffer
    the caller still holds; it takes a second buffer and release(k) gives both back."""
    with TensorSwapper(tmp_path, buffer_bytes=4096, buffer_count=2, min_swap_bytes=0) as s:
        mine = s.new_buffer("k", (16,), torch.float32)
        mine.fill_(7.0)
        s.swap_out("k", torch.full((16,), 2.0)).result()
        assert s.swap_in("k").result().tolist() == [2.0] * 16
        assert mine.tolist() == [7.0] * 16
        assert s.buffers_in_use() == 2
        s.release("k")
        s.wait()
        assert s.buffers_in_use() == 0
        s.swap_out("a", torch.ones(16)).result()
        s.swap_out("b", torch.ones(16)).result()
        s.swap_in("a").result()
        assert s.swap_in("b").result().tolist() == [1.0] * 16


def test_swap_out_from_the_held_buffer_gives_the_new_shape_and_clears_a_failed_read(tmp_path):
    with TensorSwapper(tmp_path, buffer_bytes=4096, buffer_count=2, min_swap_bytes=0) as s:
        buf = s.new_buffer("k", (16,), torch.float32)
        buf.copy_(torch.arange(16.0))
        s.swap_out("k", buf).result()
        assert s.swap_in("k").result().shape == (16,)
        s.swap_out("k", buf[:8]).result()                  # a prefix of the same buffer
        got = s.swap_in("k").result()
        assert got.tolist() == torch.arange(8.0).tolist() and got.data_ptr() == buf.data_ptr()
        s.new_buffer("j", (4,), torch.float32)
        assert s.swap_in("j").exception() is not None      # never written: the read fails
        b = s.held_buffer("j")[:16].view(torch.float32)
        b.fill_(5.0)
        s.swap_out("j", b).result()
        assert s.swap_in("j").result().tolist() == [5.0] * 4


def test_a_kept_future_does_not_keep_later_ops_tensors_alive(tmp_path):
    # concurrent.futures keeps done-callbacks: the chain's closures must drop the tensors they
    # hold once used, or a caller keeping one future (e.g. the last write's) keeps every later
    # read target and written tensor of the key alive (parameter offload relies on this)
    import gc
    import weakref

    with TensorSwapper(tmp_path, buffer_count=0, min_swap_bytes=0) as sw:
        first = sw.swap_out("k", torch.randn(1000))
        later = torch.randn(1000)
        gone_written = weakref.ref(later)
        sw.swap_out("k", later).result()
        target = torch.empty(1000)
        gone_read = weakref.ref(target)
        assert torch.equal(sw.swap_in("k", out=target).result(), target)
        del later, target
        gc.collect()
        assert first.done() and gone_written() is None and gone_read() is None
        with pytest.raises(deepnvme.SwapBufferError, match="no buffer pool"):
            sw.swap_in("k")
