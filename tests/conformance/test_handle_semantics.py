"""One suite every handle/back-end passes: DeepSpeed's aio semantics plus deepnvme's guarantees."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import deepnvme
from deepnvme.config import IOConfig

from ..conftest import random_tensor, same_bytes, shm_dir
from ..fakes import FakeStagedHandle, fake_gds_handle_class
from ._cuda_mirror import backends as cuda_backends

BACKENDS = {
    "direct-p1": lambda: deepnvme.AioHandle(block_size=64 * 1024, queue_depth=4, intra_op_parallelism=1),
    "direct-p3": lambda: deepnvme.AioHandle(block_size=8192, queue_depth=16, intra_op_parallelism=3),
    "buffered-p2": lambda: deepnvme.AioHandle(config=IOConfig(block_size=32 * 1024, intra_op_parallelism=2,
                                                              o_direct=False)),
    # the CUDA route of AioHandle (pinned staging pipeline) with CPU tensors and a fake copier
    "staged-fake": lambda: FakeStagedHandle(block_size=8192, queue_depth=8, intra_op_parallelism=2),
    # GdsHandle: CPU tensors fall back to the aio path; and its cuFile path over a fake binding
    "gds-cpu": lambda: deepnvme.GdsHandle(block_size=16384, queue_depth=8, intra_op_parallelism=2),
    "gds-fake-cufile": lambda: fake_gds_handle_class()(block_size=8192, intra_op_parallelism=3),
    # with CUDA: the same suite through CUDA tensors (staging pipeline, and cuFile where usable)
    **cuda_backends(),
}


@pytest.fixture(params=sorted(BACKENDS))
def h(request):
    handle = BACKENDS[request.param]()
    yield handle
    handle.close()


def test_getters():
    h = deepnvme.AioHandle(block_size=4096, queue_depth=8, single_submit=True, overlap_events=True,
                           intra_op_parallelism=2)
    assert h.get_block_size() == 4096 and h.get_queue_depth() == 8
    assert h.get_single_submit() is True and h.get_overlap_events() is True
    assert h.get_intra_op_parallelism() == 2 and h.get_alignment() == 2 * 512  # DeepSpeed's formula
    d = deepnvme.AioHandle()
    assert (d.get_block_size(), d.get_queue_depth(), d.get_intra_op_parallelism()) == (1 << 20, 128, 1)
    h.close(), d.close()


def test_sync_returns_one_async_returns_zero(h, tmp_path):
    t = random_tensor(100_000)
    path = str(tmp_path / "f")
    assert h.sync_pwrite(t, path) == 1
    assert os.path.getsize(path) == t.nbytes
    back = torch.empty_like(t)
    assert h.sync_pread(back, path) == 1 and same_bytes(back, t)
    back.zero_()
    assert h.async_pread(back, path) == 0
    assert h.wait() == 1 and same_bytes(back, t)
    assert h.async_pwrite(t, str(tmp_path / "g")) == 0
    assert h.wait() == 1
    assert h.wait() == 0  # nothing pending: 0, not an assertion as in DeepSpeed


def test_pread_pwrite_flags(h, tmp_path):
    t = random_tensor(5000, torch.bfloat16)
    path = str(tmp_path / "f")
    assert h.pwrite(t, path, True, False) == 1  # validate, sync
    back = torch.empty_like(t)
    assert h.pread(back, path, True, True) == 0
    assert h.wait() == 1 and same_bytes(back, t)
    assert h.write(t, path, False) == 0 and h.read(back, path, True) == 0


def test_queue_of_n_ops_one_wait(h, tmp_path):
    tensors = [random_tensor(10_000 + 37 * i, seed=i) for i in range(12)]
    for i, t in enumerate(tensors):
        assert h.async_pwrite(t, str(tmp_path / f"w{i}")) == 0
    assert h.wait() == len(tensors)
    outs = [torch.empty_like(t) for t in tensors]
    for i, o in enumerate(outs):
        h.async_pread(o, str(tmp_path / f"w{i}"))
    assert h.wait() == len(tensors)
    assert all(same_bytes(a, b) for a, b in zip(tensors, outs))


@pytest.mark.parametrize("by_fd", [False, True])
def test_progressive_offset_writes(h, tmp_path, by_fd):
    ref = random_tensor(1 << 16, torch.uint8)
    parts = torch.tensor_split(ref, [1000, 5000, 5001, 20000, 40960])
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT) if by_fd else None
    pos = 0
    try:
        for part in parts:
            part = part.clone()
            if by_fd:
                assert h.async_pwrite(part, fd, pos) == 0
                assert h.wait() == 1
            else:
                assert h.sync_pwrite(part, path, pos) == 1
            pos += part.numel()
            with open(path, "rb") as f:
                assert f.read() == ref[:pos].numpy().tobytes()
    finally:
        if fd is not None:
            os.close(fd)


def test_partial_reads_at_offsets(h, tmp_path):
    ref = random_tensor(300_000, torch.uint8)
    path = str(tmp_path / "f")
    h.sync_pwrite(ref, path)
    for off, n in [(0, 1), (1, 4095), (4095, 2), (4096, 4096), (12345, 100_000), (299_999, 1),
                   (0, 300_000), (65536, 131072)]:
        out = torch.empty(n, dtype=torch.uint8)
        assert h.sync_pread(out, path, off) == 1
        assert same_bytes(out, ref[off:off + n]), (off, n)


def test_unaligned_sizes_keep_their_tails(h, tmp_path):
    """DeepSpeed issue #1070: bytes past the last aligned block must not be dropped."""
    for n in (1, 511, 513, 4097, 65537, 1_000_003):
        t = random_tensor(n, torch.uint8, seed=n)
        path = str(tmp_path / f"t{n}")
        h.sync_pwrite(t, path)
        assert os.path.getsize(path) == n
        back = torch.empty_like(t)
        h.sync_pread(back, path)
        assert same_bytes(back, t)


def test_misaligned_buffer_address(h, tmp_path):
    base = random_tensor(200_001, torch.uint8)
    view = base[1:]  # data_ptr % 512 != 0: forces bounce buffers under O_DIRECT
    path = str(tmp_path / "f")
    h.sync_pwrite(view, path)
    back_base = torch.zeros(200_003, dtype=torch.uint8)
    back = back_base[3:]
    h.sync_pread(back, path)
    assert same_bytes(back, view)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8,
                                   torch.bool, torch.int64, torch.complex64])
def test_every_dtype(h, tmp_path, dtype):
    t = random_tensor(3001, torch.uint8).to(torch.bool) if dtype is torch.bool else random_tensor(3001, dtype)
    path = str(tmp_path / "f")
    h.sync_pwrite(t, path)
    back = torch.empty_like(t)
    h.sync_pread(back, path)
    assert same_bytes(back, t)


def test_locked_tensors(h, tmp_path):
    t = h.new_cpu_locked_tensor(50_000, torch.empty(0, dtype=torch.float16))
    assert t.dtype == torch.float16 and t.numel() == 50_000 and h.is_pinned(t)
    t.copy_(random_tensor(50_000, torch.float16))
    path = str(tmp_path / "f")
    h.sync_pwrite(t, path)
    u = h.new_cpu_locked_tensor(50_000, t)
    h.sync_pread(u, path)
    assert same_bytes(u, t)
    assert h.free_cpu_locked_tensor(t) and h.free_cpu_locked_tensor(u)
    assert not h.free_cpu_locked_tensor(torch.empty(3))


def test_zero_byte_ops(h, tmp_path):
    path = str(tmp_path / "empty")
    assert h.sync_pwrite(torch.empty(0), path) == 1
    assert os.path.getsize(path) == 0
    assert h.sync_pread(torch.empty(0), path) == 1


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(size=st.integers(0, 300_000), offset=st.integers(0, 70_000), lead=st.integers(0, 700),
       parallelism=st.integers(1, 4), block=st.sampled_from([512, 4096, 12288, 65536, 100_000]),
       o_direct=st.booleans())
def test_round_trip_property(tmp_path, size, offset, lead, parallelism, block, o_direct):
    cfg = IOConfig(block_size=block, intra_op_parallelism=parallelism, queue_depth=5, o_direct=o_direct)
    path = str(tmp_path / "prop")
    if os.path.exists(path):
        os.unlink(path)
    with deepnvme.AioHandle(config=cfg) as h:
        prefix = random_tensor(offset, torch.uint8, seed=1)
        h.sync_pwrite(prefix, path)  # the bytes before the offset must survive the write
        data = random_tensor(size + lead, torch.uint8, seed=size)[lead:]
        h.sync_pwrite(data, path, offset)
        assert os.path.getsize(path) == max(offset + size, offset)
        back = torch.full((size + 3,), 7, dtype=torch.uint8)[3:]
        h.sync_pread(back, path, offset)
        assert same_bytes(back, data)
        head = torch.empty(offset, dtype=torch.uint8)
        h.sync_pread(head, path, 0)
        assert same_bytes(head, prefix)


def test_tmpfs_round_trip(tmp_path):
    d = shm_dir(f"deepnvme-test-{os.getpid()}")
    if d is None:
        pytest.skip("no writable /dev/shm")
    path = os.path.join(d, "f")
    try:
        with deepnvme.AioHandle(block_size=8192, intra_op_parallelism=2) as h:
            t = random_tensor(50_001, torch.uint8)
            h.sync_pwrite(t, path)
            back = torch.empty_like(t)
            h.sync_pread(back, path, 0)
            assert same_bytes(back, t)
    finally:
        os.unlink(path)
        os.rmdir(d)


def test_started_ops_cannot_be_cancelled(h, tmp_path):
    """Regression: a cancelled future used to kill the worker thread and hang later ops."""
    t = random_tensor(50_000, torch.uint8)
    path = str(tmp_path / "f")
    fut = h.submit_write(t, path)
    assert fut.cancel() is False
    assert fut.result(timeout=30) == t.numel()
    back = torch.empty_like(t)
    fut = h.submit_read(back, path)
    fut.cancel()
    assert fut.result(timeout=30) == t.numel() and same_bytes(back, t)
    assert h.sync_pread(back, path) == 1
