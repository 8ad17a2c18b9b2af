"""TensorSwapper on real files: round trips, the buffer pool, failures and cleanup."""

import errno
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import deepnvme
from deepnvme.swap import SwapBufferError, SwapError, TensorSwapper

from ...fakes import FullDisk

SRC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "src")




def rand(shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.fixture
def swapper(tmp_path):
    s = TensorSwapper(tmp_path, buffer_bytes=1 << 20, buffer_count=3, min_swap_bytes=1024)
    yield s
    s.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.uint8])
def test_round_trip_into_pool_buffer_and_into_out(swapper, dtype):
    t = rand((37, 101), dtype)
    assert swapper.swap_out("t", t).result() is None
    back = swapper.swap_in("t").result()
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    assert deepnvme.is_pinned(back) or not deepnvme.is_pinned(swapper.held_buffer("t"))
    swapper.release("t")
    out = torch.empty_like(t)
    assert swapper.swap_in("t", out=out).result() is out and torch.equal(out, t)
    assert os.path.getsize(os.path.join(swapper.directory, "0.swp")) == t.numel() * t.element_size()


def test_small_tensors_stay_in_memory(swapper):
    small = torch.arange(10.0)
    swapper.swap_out("s", small).result()
    small.add_(1)  # the swapper kept its own copy
    assert torch.equal(swapper.swap_in("s").result(), torch.arange(10.0))
    assert os.listdir(swapper.directory) == ["owner.json"]


def test_ops_on_one_key_keep_their_order(swapper):
    a, b = rand(5000, seed=1), rand(5000, seed=2)
    swapper.swap_out("k", a)
    swapper.swap_out("k", b)
    fut = swapper.swap_in("k")          # queued behind both writes
    assert torch.equal(fut.result(), b)
    fut.result().mul_(3)
    swapper.swap_out("k", fut.result())  # zero-copy write from the key's own buffer
    swapper.release("k")
    swapper.prefetch(["k"])
    assert torch.equal(swapper.swap_in("k").result(), b * 3)
    swapper.wait()


def test_new_buffer_is_written_without_copy_and_reused(swapper):
    buf = swapper.new_buffer("n", (100, 100), torch.float32)
    buf.copy_(rand((100, 100), seed=3))
    swapper.swap_out("n", buf).result()
    assert swapper.swap_in("n").result().data_ptr() == buf.data_ptr()  # still held: no read
    swapper.release("n")
    assert swapper.buffers_in_use() == 0
    assert torch.equal(swapper.swap_in("n").result(), rand((100, 100), seed=3))


def test_tensor_larger_than_a_buffer_fails_at_swap_out_and_changes_nothing(swapper):
    """A tensor no buffer can hold is refused by swap_out itself (not later by swap_in): the
    error names the key, both sizes and the setting; no I/O starts and the old value stays."""
    big = torch.zeros((1 << 20) // 4 + 1)
    with pytest.raises(SwapBufferError, match=r"key 'big'.* 1048580 bytes .* 1048576 bytes.*"
                                              r"buffer_bytes >= 1048580"):
        swapper.swap_out("big", big)
    assert "big" not in swapper and os.listdir(swapper.directory) == ["owner.json"]
    old = rand(5000, seed=7)
    swapper.swap_out("k", old).result()
    with pytest.raises(SwapBufferError, match="key 'k'"):
        swapper.swap_out("k", big)
    assert swapper.nbytes("k") == 20000 and torch.equal(swapper.swap_in("k").result(), old)
    with pytest.raises(SwapBufferError, match=r"needs 1048580 bytes .* 1048576 bytes each"):
        swapper.new_buffer("n", big.shape, big.dtype)
    with pytest.raises(SwapBufferError, match="out has 4 bytes"):
        swapper.swap_in("k", out=torch.empty(1))


def test_tensor_kept_in_memory_may_exceed_a_buffer(tmp_path):
    with TensorSwapper(tmp_path, buffer_bytes=1024, min_swap_bytes=1 << 20) as s:
        s.swap_out("m", rand(4096)).result()            # 16 KiB: under min_swap_bytes, no file
        assert torch.equal(s.swap_in("m").result(), rand(4096))


def test_exhausted_pool_raises_at_once_when_nothing_is_released(swapper):
    for k in range(4):
        swapper.swap_out(k, rand(1000, seed=k))
    held = [swapper.swap_in(k).result() for k in range(3)]
    with pytest.raises(SwapBufferError, match=r"all 3 pool buffers of 1048576 bytes are held"):
        swapper.swap_in(3)
    assert torch.equal(held[0], rand(1000, seed=0))


def test_exhausted_pool_waits_for_a_release(swapper):
    for k in range(4):
        swapper.swap_out(k, rand(1000, seed=k))
    for k in range(3):
        swapper.swap_in(k).result()
    swapper.release(0)
    assert torch.equal(swapper.swap_in(3).result(), rand(1000, seed=3))  # got buffer 0's

    got = []
    swapper.swap_out(0, rand(200_000, seed=9))   # big enough to still run while we wait
    held = swapper.swap_in(1).result()
    swapper.swap_out(1, held)
    swapper.release(1)                            # deferred until that write ends
    t = threading.Thread(target=lambda: got.append(swapper.swap_in(0).result().clone()))
    t.start()
    t.join(30)
    assert torch.equal(got[0], rand(200_000, seed=9))


def test_acquire_timeout_waits_for_other_threads(tmp_path):
    with TensorSwapper(tmp_path, buffer_bytes=1 << 16, buffer_count=1, min_swap_bytes=0,
                       acquire_timeout=0.05) as s:
        s.swap_out("a", torch.zeros(1000)).result()
        s.swap_out("b", torch.ones(1000)).result()
        s.swap_in("a").result()
        t0 = time.monotonic()
        with pytest.raises(SwapBufferError, match=r"after 0.05 s: all 1 buffers of 65536 bytes"):
            s.swap_in("b")
        assert 0.04 < time.monotonic() - t0 < 5
        s.acquire_timeout = 30
        threading.Timer(0.1, s.release, args=("a",)).start()
        assert torch.equal(s.swap_in("b").result(), torch.ones(1000))


def test_full_disk_fails_the_write_and_keeps_the_data(tmp_path):
    posix = FullDisk()
    s = TensorSwapper(tmp_path, min_swap_bytes=0, handle=deepnvme.AioHandle(posix=posix))
    t = rand(10_000, seed=4)
    s.swap_out("x", t).result()
    buf = s.swap_in("x").result()
    buf.add_(1)
    posix.full.add("0.swp")
    fut = s.swap_out("x", buf)
    s.release("x")
    with pytest.raises(SwapError, match="swap_out of key 'x'") as info:
        fut.result()
    assert info.value.errno == errno.ENOSPC and info.value.path.endswith("0.swp")
    assert "(40000 bytes)" in str(info.value) and info.value.size > 0
    assert torch.equal(s.swap_in("x").result(), t + 1)   # the buffer was kept, data intact
    s.release("x")                                       # still the only copy: kept
    assert torch.equal(s.swap_in("x").result(), t + 1)
    with pytest.raises(SwapError):
        s.wait()
    posix.full.clear()
    s.swap_out("x", s.swap_in("x").result()).result()
    s.release("x")
    assert s.buffers_in_use() == 0
    assert torch.equal(s.swap_in("x").result(), t + 1)
    posix.full.add("0.swp")
    with pytest.raises(SwapError):
        s.swap_out("x", s.swap_in("x").result()).result()
    s.release("x", force=True)
    assert s.buffers_in_use() == 0
    s.close()


def test_vanished_directory_is_named(tmp_path):
    s = TensorSwapper(tmp_path, min_swap_bytes=0)
    s.swap_out("x", rand(1000)).result()
    deepnvme.swap._dirs.remove_dir(s.directory)
    with pytest.raises(SwapError, match="has vanished") as info:
        s.swap_in("x").result()
    assert info.value.errno == errno.ENOENT
    kept = rand(1000, seed=5)
    with pytest.raises(SwapError, match="vanished.*tensor passed to swap_out is untouched"):
        s.swap_out("y", kept).result()
    assert torch.equal(kept, rand(1000, seed=5))
    s.close()


def test_close_removes_files_and_stale_dirs_are_detected(tmp_path):
    s = TensorSwapper(tmp_path, min_swap_bytes=0)
    s.swap_out("a", rand(1000))
    path = s.directory
    s.close()
    s.close()
    assert not os.path.exists(path)
    with pytest.raises(RuntimeError, match="closed"):
        s.swap_out("a", rand(10))

    script = ("import os, torch; from deepnvme.swap import TensorSwapper; "
              f"s = TensorSwapper({str(tmp_path)!r}, min_swap_bytes=0); "
              "s.swap_out('a', torch.zeros(1000)).result(); print(s.directory, flush=True); "
              "{}")
    env = {**os.environ, "PYTHONPATH": SRC}
    # a normal exit without close() removes the directory (atexit)
    out = subprocess.run([sys.executable, "-c", script.format("")], env=env, check=True,
                         capture_output=True, text=True).stdout.strip()
    assert not os.path.exists(out)
    # a crash leaves it behind: the next swapper detects it
    out = subprocess.run([sys.executable, "-c", script.format("os._exit(1)")], env=env,
                         capture_output=True, text=True).stdout.strip()
    assert os.path.isfile(os.path.join(out, "0.swp"))
    with pytest.warns(RuntimeWarning, match="stale swap directory"):
        s = TensorSwapper(tmp_path)
    assert s.stale_dirs == [out]
    s.close()
    with pytest.raises(SwapError, match="stale"):
        TensorSwapper(tmp_path, stale="error")
    s = TensorSwapper(tmp_path, stale="remove")
    assert not os.path.exists(out)
    s.close()


def test_unknown_key_and_bad_tensor(swapper):
    with pytest.raises(KeyError, match="'nope'"):
        swapper.swap_in("nope")
    with pytest.raises(deepnvme.UnsupportedBufferError):
        swapper.swap_out("t", torch.zeros(10, 10).t())


def test_many_keys_through_a_small_pool(tmp_path):
    with TensorSwapper(tmp_path, buffer_bytes=1 << 16, buffer_count=2, min_swap_bytes=0) as s:
        ts = {k: rand(2000, seed=k) for k in range(20)}
        for k, t in ts.items():
            s.swap_out(k, t)
        for k in range(20):
            s.prefetch([k])
            assert torch.equal(s.swap_in(k).result(), ts[k])
            s.release(k)
        s.discard(3)
        assert 3 not in s and not os.path.exists(os.path.join(s.directory, "3.swp"))


def test_threads_share_one_swapper(tmp_path):
    """Four threads swap their own keys out and in at once through two buffers: each waits
    for the others' releases (acquire_timeout) and every tensor comes back intact."""
    threads, keys_each, rounds = 4, 6, 3
    errors: list[BaseException] = []
    start = threading.Barrier(threads)
    with TensorSwapper(tmp_path, buffer_bytes=1 << 16, buffer_count=2, min_swap_bytes=0,
                       acquire_timeout=30) as s:
        def work(tid: int) -> None:
            try:
                mine = {f"t{tid}-{k}": rand(3000 + k, seed=100 * tid + k) for k in range(keys_each)}
                start.wait()
                for k, t in mine.items():
                    s.swap_out(k, t).result()
                for r in range(rounds):
                    for k, t in mine.items():
                        back = s.swap_in(k).result()
                        assert torch.equal(back, t), (k, r)
                        s.release(k)
            except BaseException as exc:  # reported below, with the thread's traceback
                errors.append(exc)

        pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join(120)
        assert not any(t.is_alive() for t in pool), "a thread is stuck"
        assert errors == []
        assert all(f"t{i}-{k}" in s for i in range(threads) for k in range(keys_each))
