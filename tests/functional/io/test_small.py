"""Batches of small direct reads on the small-read queues (deepnvme.io.small): the bytes land
where asked with uneven sizes and several parts, an end of file met mid-read and a failing
queue fail the batch naming the file, the handle goes on, and nothing leaks (descriptors,
rings, threads)."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

import deepnvme
from deepnvme.config import IOConfig
from deepnvme.errors import DeepNVMeIOError, ShortTransferError
from deepnvme.io import small
from deepnvme.io.batch import Items
from deepnvme.memory.views import aligned_empty

from ...conftest import open_fds, random_tensor, same_bytes
from ...fake_queues import install_faulty_queue
from ._kernel_handles import KERNEL_ENGINES, make

ENGINE_SPECIFIC = True  # each test names its engine
pytestmark = pytest.mark.skipif(not KERNEL_ENGINES, reason="no kernel engine on this system")
PAGE = 4096


def uneven(path, count=300, seed=3):
    """A file and reads of 1-4 pages each at shuffled page offsets: (data, buf, at, offs, sizes)."""
    pages = 4 * count
    data = random_tensor(pages * PAGE, torch.uint8, seed=seed)
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
    g = torch.Generator().manual_seed(seed)
    sizes = (torch.randint(1, 5, (count,), generator=g) * PAGE).to(torch.int64)
    offs = torch.randperm(pages - 4, generator=g)[:count].to(torch.int64) * PAGE
    at = torch.cumsum(sizes, 0) - sizes
    return data, aligned_empty(int(sizes.sum())), at, offs, sizes


def expected_of(data, at, offs, sizes, nbytes):
    out = torch.empty(nbytes, dtype=torch.uint8)
    for a, o, n in zip(at.tolist(), offs.tolist(), sizes.tolist()):
        out[a:a + n] = data[o:o + n]
    return out


def test_uneven_reads_in_several_parts_land_where_asked(tmp_path, kernel, monkeypatch):
    path = str(tmp_path / "f")
    data, buf, at, offs, sizes = uneven(path)
    ran = []
    real = small._run
    monkeypatch.setattr(small, "_run",
                        lambda kq, part, single: ran.append(part.sizes.numel()) or real(kq, part, single))
    with make(kernel) as h:
        n = h.read_many_into(path, buf, buffer_offsets=at, file_offsets=offs, sizes=sizes).result()
        names = {t.name for t in threading.enumerate()}
    assert n == int(sizes.sum()) and same_bytes(buf, expected_of(data, at, offs, sizes, buf.numel()))
    assert sorted(ran) == [150, 150]  # two parts, one per worker
    assert any(name.startswith(f"deepnvme-small-{kernel}") for name in names)


@pytest.mark.parametrize("most", [0, 8])
def test_a_call_submits_at_most_submit_most_reads(tmp_path, kernel, monkeypatch, most):
    """At most SUBMIT_MOST reads per system call where set (0: every free slot at once),
    counted at the system call itself; the queue still fills to its depth."""
    from deepnvme.io import aio, uring

    monkeypatch.setattr(small, "SUBMIT_MOST", most)
    path = str(tmp_path / "f")
    data, buf, at, offs, sizes = uneven(path, count=200)
    counts = []
    if kernel == "aio":
        real = aio._submit_call
        monkeypatch.setattr(aio, "_submit_call",
                            lambda fn, ctx, n, ptrs: counts.append(n) or real(fn, ctx, n, ptrs))
    else:
        real = uring._enter
        monkeypatch.setattr(uring, "_enter",
                            lambda nr, fd, n, *rest: counts.append(n) or real(nr, fd, n, *rest))
    with make(kernel, intra_op_parallelism=1, queue_depth=32) as h:
        n = h.read_many_into(path, buf, buffer_offsets=at, file_offsets=offs, sizes=sizes).result()
    assert n == int(sizes.sum()) and same_bytes(buf, expected_of(data, at, offs, sizes, buf.numel()))
    submitted = [c for c in counts if c]
    assert sum(submitted) >= 200 and max(submitted) == (most or 32)


def test_single_submit_submits_one_entry_per_call(tmp_path, kernel, monkeypatch):
    path = str(tmp_path / "f")
    data, buf, at, offs, sizes = uneven(path, count=80)
    queues = install_faulty_queue(monkeypatch, kernel)
    calls = []
    with make(kernel, single_submit=True, intra_op_parallelism=1) as h:
        h.read_many_into(path, buf, buffer_offsets=at[:1], file_offsets=offs[:1], sizes=sizes[:1]).result()
        real = queues[0].inner.submit_wait
        monkeypatch.setattr(queues[0].inner, "submit_wait",
                            lambda wait, single=False: calls.append(single) or real(wait, single))
        n = h.read_many_into(path, buf, buffer_offsets=at, file_offsets=offs, sizes=sizes).result()
    assert n == int(sizes.sum()) and same_bytes(buf, expected_of(data, at, offs, sizes, buf.numel()))
    assert calls and all(calls)


def test_read_many_items_take_the_small_path(tmp_path, kernel, monkeypatch):
    path = str(tmp_path / "f")
    data, _, _, offs, sizes = uneven(path, count=40)
    ran = []
    real = small._run
    monkeypatch.setattr(small, "_run", lambda kq, part, single: ran.append(1) or real(kq, part, single))
    bufs = [aligned_empty(n, min_bytes=0) for n in sizes.tolist()]
    with make(kernel) as h:
        assert h.read_many(path, list(zip(bufs, offs.tolist()))).result() == int(sizes.sum())
    assert ran and all(same_bytes(b, data[o:o + b.numel()]) for b, o in zip(bufs, offs.tolist()))


def test_end_of_file_mid_read_names_the_file(tmp_path, kernel):
    path = str(tmp_path / "f")
    _, buf, at, offs, sizes = uneven(path, count=50)
    with pytest.MonkeyPatch.context() as mp:
        install_faulty_queue(mp, kernel, zero_read=True)
        with make(kernel) as h:
            with pytest.raises(ShortTransferError) as info:
                h.read_many_into(path, buf, buffer_offsets=at, file_offsets=offs, sizes=sizes).result()
    assert info.value.path == path and "end of file" in str(info.value)


def test_a_failing_queue_fails_the_batch_and_the_next_one_runs(tmp_path, kernel, monkeypatch):
    path = str(tmp_path / "f")
    data, buf, at, offs, sizes = uneven(path, count=64)
    queues = install_faulty_queue(monkeypatch, kernel)
    calls = {"n": 0}

    def broken_once(wait, single=False):
        calls["n"] += 1
        raise OSError(errno.EFAULT, "injected")

    before, rings = open_fds(), open_fds(rings=True)
    with make(kernel, intra_op_parallelism=1) as h:
        first = h.read_many_into(path, buf, buffer_offsets=at[:2], file_offsets=offs[:2], sizes=sizes[:2])
        assert first.result() == int(sizes[:2].sum())
        queues[-1].submit_wait = broken_once
        with pytest.raises(DeepNVMeIOError) as info:
            h.read_many_into(path, buf, buffer_offsets=at, file_offsets=offs, sizes=sizes).result()
        assert info.value.errno == errno.EFAULT and info.value.path == path and calls["n"] == 1
        n = h.read_many_into(path, buf, buffer_offsets=at, file_offsets=offs, sizes=sizes).result()
        assert n == int(sizes.sum()) and len(queues) == 2  # a new queue after the failure
    assert same_bytes(buf, expected_of(data, at, offs, sizes, buf.numel()))
    assert open_fds() == before and open_fds(rings=True) == rings


def test_close_waits_for_small_batches_in_flight(tmp_path, kernel):
    path = str(tmp_path / "f")
    data, buf, at, offs, sizes = uneven(path)
    before = threading.active_count()
    h = make(kernel, queue_depth=4, intra_op_parallelism=1)
    futures = [h.read_many_into(path, buf, buffer_offsets=at, file_offsets=offs, sizes=sizes)
               for _ in range(3)]
    h.close()
    assert [f.result(timeout=0) for f in futures] == [int(sizes.sum())] * 3
    assert same_bytes(buf, expected_of(data, at, offs, sizes, buf.numel()))
    assert threading.active_count() == before
    with pytest.raises(RuntimeError):
        h.read_many_into(path, buf, buffer_offsets=at, file_offsets=offs, sizes=sizes)


def test_large_or_validated_reads_stay_on_the_window(tmp_path, kernel, monkeypatch):
    path = str(tmp_path / "f")
    data = random_tensor(64 * PAGE * 4, torch.uint8)
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
    ran = []
    monkeypatch.setattr(small, "_run", lambda kq, part, single: ran.append(1))
    big = aligned_empty(128 << 10)
    parts = [aligned_empty(PAGE, min_bytes=0), aligned_empty(PAGE, min_bytes=0)]
    with make(kernel) as h:
        assert h.read_many(path, [(big, 0)]).result() == big.numel()
        assert h.read_many(path, [(p, i * PAGE) for i, p in enumerate(parts)], validate=True).result() == 2 * PAGE
    assert not ran and same_bytes(big, data[:big.numel()])


def test_a_failing_size_check_after_a_short_read_fails_the_batch(tmp_path, kernel, monkeypatch):
    from deepnvme.io.posix import Posix

    class SizeFailsLater(Posix):
        calls = 0

        def file_size(self, fd):
            type(self).calls += 1
            if type(self).calls > 1:  # the batch's own check passes; the one after a short read fails
                raise OSError(errno.EIO, "injected")
            return super().file_size(fd)

    path = str(tmp_path / "f")
    _, buf, at, offs, sizes = uneven(path, count=64)
    install_faulty_queue(monkeypatch, kernel, max_len=PAGE)
    before = open_fds()
    with deepnvme.AioHandle(config=IOConfig(block_size=1 << 20, queue_depth=8, intra_op_parallelism=1,
                                            engine=kernel), posix=SizeFailsLater()) as h:
        with pytest.raises(OSError) as info:
            h.read_many_into(path, buf, buffer_offsets=at, file_offsets=offs, sizes=sizes).result(timeout=30)
        assert info.value.errno == errno.EIO
    assert open_fds() == before


def test_a_part_frees_its_tensors_before_its_batch_completes(tmp_path, kernel, monkeypatch):
    """The small-read thread holds no tensor of a batch once its future is done (a daemon thread
    freeing a tensor while the interpreter exits aborts the process); the completion is delayed on
    the worker after the future is set, so a reference kept until then would still be alive."""
    import time
    import weakref

    path = str(tmp_path / "f")
    _data, buf, at, offs, sizes = uneven(path, count=100)
    real = small._Job.part_done

    def late(self, nbytes):
        real(self, nbytes)
        time.sleep(0.2)  # the worker lingers after completing the batch

    monkeypatch.setattr(small._Job, "part_done", late)
    with make(kernel, intra_op_parallelism=1) as h:
        absolute = at + buf.data_ptr()
        alive = [weakref.ref(t) for t in (absolute, offs, sizes)]
        items = Items(absolute.tolist(), sizes.tolist(), offs.tolist(), buf, None, (absolute, offs, sizes))
        future = h._engine.submit_many(False, path, items, validate=False, fsync=None)
        total = int(sizes.sum())
        del absolute, offs, sizes, items
        assert future.result() == total
        assert [r() for r in alive] == [None, None, None]
