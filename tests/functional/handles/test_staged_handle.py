"""AioHandle's staged (CUDA) route, driven on CPU by a fake copier: same results, futures and
errors as the direct route, on the real engine and disk."""

from __future__ import annotations

import errno

import pytest
import torch

import deepnvme
from deepnvme.errors import DeepNVMeIOError, FileNotFoundIOError, ShortTransferError, UnsupportedBufferError

from ...conftest import random_tensor, same_bytes
from ...fakes import FakeStagedHandle, fake_gds_handle_class
from ..io.test_faults import FaultyPosix

KINDS = {"direct": deepnvme.AioHandle, "staged": FakeStagedHandle}


@pytest.fixture(params=sorted(KINDS))
def kind(request):
    return request.param


def make(kind, **kw):
    return KINDS[kind](block_size=8192, queue_depth=8, intra_op_parallelism=2, **kw)


def test_cpu_tensors_really_take_the_staged_route(tmp_path):
    h = FakeStagedHandle(block_size=8192, intra_op_parallelism=2)
    t = random_tensor(100_000, torch.uint8)
    h.sync_pwrite(t, str(tmp_path / "f"))
    copier = h._staging_pipeline.copier
    assert copier.begun == 1 and copier.calls == -(-100_000 // FakeStagedHandle.chunk_bytes)
    h.close()
    plain = deepnvme.AioHandle()
    plain.sync_pwrite(t, str(tmp_path / "g"))
    assert plain._staging_pipeline is None
    plain.close()


def test_read_past_eof_same_error(tmp_path, kind):
    path = str(tmp_path / "f")
    with make(kind) as h:
        h.sync_pwrite(random_tensor(10_000, torch.uint8), path)
        with pytest.raises(ShortTransferError) as info:
            h.sync_pread(torch.empty(5000, dtype=torch.uint8), path, 6000)
    e = info.value
    assert (e.path, e.offset, e.size, e.transferred, e.errno) == (path, 6000, 5000, 0, errno.EIO)


def test_missing_file_same_error(tmp_path, kind):
    path = str(tmp_path / "nope" / "f")
    with make(kind) as h:
        with pytest.raises(FileNotFoundIOError) as info:
            h.sync_pread(torch.empty(50_000, dtype=torch.uint8), path)
        assert info.value.path == path
        with pytest.raises(FileNotFoundError):
            h.sync_pwrite(torch.empty(10, dtype=torch.uint8), path)


def test_async_failures_surface_at_wait_with_the_same_counting(tmp_path, kind):
    good = str(tmp_path / "good")
    with make(kind) as h:
        t = random_tensor(40_000, torch.uint8)
        h.sync_pwrite(t, good)
        outs = [torch.empty_like(t) for _ in range(3)]
        assert h.async_pread(outs[0], good) == 0
        assert h.async_pread(outs[1], str(tmp_path / "missing")) == 0
        assert h.async_pread(outs[2], good) == 0
        with pytest.raises(FileNotFoundIOError):
            h.wait()
        assert h.wait() == 0
        assert same_bytes(outs[0], t) and same_bytes(outs[2], t)
        fut = h.submit_read(outs[0], good, offset=0)
        assert fut.result() == t.nbytes and h.wait() == 0  # futures are not counted by wait()


def test_enospc_mid_request_names_the_file(tmp_path, kind):
    path = str(tmp_path / "f")
    h = make(kind, posix=FaultyPosix(fail_write_at=40_000))
    h.async_pwrite(random_tensor(100_000, torch.uint8), path)
    with pytest.raises(DeepNVMeIOError) as info:
        h.wait()
    assert info.value.errno == errno.ENOSPC and info.value.path == path
    h.close()


def test_eio_on_read_surfaces(tmp_path, kind):
    path = str(tmp_path / "f")
    with make(kind) as h:
        h.sync_pwrite(random_tensor(100_000, torch.uint8), path)
    h = make(kind, posix=FaultyPosix(fail_read_at=50_000))
    with pytest.raises(DeepNVMeIOError) as info:
        h.sync_pread(torch.empty(100_000, dtype=torch.uint8), path)
    assert info.value.errno == errno.EIO and info.value.path == path
    h.close()


def test_fsync_and_validate_through_staging(tmp_path):
    posix = FaultyPosix()
    calls = []
    posix.fsync = lambda fd: calls.append(fd)  # type: ignore[method-assign]
    h = FakeStagedHandle(block_size=8192, posix=posix)
    t = random_tensor(70_000, torch.uint8)
    fut = h.submit_write(t, str(tmp_path / "f"), validate=True, fsync=True)
    assert fut.result() == 70_000 and len(calls) == 1
    back = torch.empty_like(t)
    assert h.pread(back, str(tmp_path / "f"), True, False) == 1 and same_bytes(back, t)
    h.close()


def test_non_contiguous_is_refused(tmp_path):
    with FakeStagedHandle() as h:
        with pytest.raises(UnsupportedBufferError, match="not contiguous"):
            h.sync_pwrite(torch.zeros(8, 8).t(), str(tmp_path / "f"))


def test_close_waits_for_staged_async_ops(tmp_path):
    h = FakeStagedHandle(block_size=8192)
    h.copy_delay = 0.002
    t = random_tensor(200_000, torch.uint8)
    h.async_pwrite(t, str(tmp_path / "f"))
    h.close()
    assert (tmp_path / "f").read_bytes() == bytes(t.numpy())


@pytest.mark.parametrize("make_handle", [lambda: FakeStagedHandle(block_size=8192),
                                         lambda: fake_gds_handle_class()(block_size=8192)])
def test_closed_handle_refuses_staged_work(tmp_path, make_handle):
    h = make_handle()
    h.close()
    with pytest.raises(RuntimeError, match="closed"):
        h.sync_pwrite(torch.zeros(10), str(tmp_path / "f"))


def test_dropped_handle_is_collected_and_finishes_its_writes(tmp_path):
    import weakref
    h = FakeStagedHandle(block_size=8192)
    h.copy_delay = 0.002
    t = random_tensor(100_000, torch.uint8)
    h.async_pwrite(t, str(tmp_path / "f"))
    ref = weakref.ref(h)
    del h
    assert ref() is None, "the staging pipeline must not keep its handle alive"
    assert (tmp_path / "f").read_bytes() == bytes(t.numpy())
