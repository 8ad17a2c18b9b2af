"""CUDA tensors through AioHandle's staging pipeline and through GdsHandle (cuFile).

The same semantics as the CPU suites (sync/async/queue/offsets/unaligned/dtypes/errors), plus
stream ordering. Skipped without CUDA; GdsHandle cases also skip where cuFile is unusable.
"""

from __future__ import annotations

import os

import pytest
import torch

import deepnvme
from deepnvme.compat import AsyncIOBuilder, GDSBuilder
from deepnvme.errors import DeepNVMeIOError, FileNotFoundIOError, ShortTransferError

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class SmallChunkAio(deepnvme.AioHandle):
    """Staging chunks of 64 KiB so small tensors still cross many chunks and ring slots."""

    def _staging_options(self):
        return {"chunk_bytes": 64 * 1024, "buffers": 2, "alignment": self.config.alignment}


def _gds():
    status = deepnvme.gds_status()
    if not status.available:
        pytest.skip(f"cuFile unavailable: {status.detail}")
    return deepnvme.GdsHandle(block_size=64 * 1024, queue_depth=8, intra_op_parallelism=2)


KINDS = {
    "aio-staged": lambda: deepnvme.AioHandle(block_size=64 * 1024, queue_depth=8, intra_op_parallelism=2),
    "aio-staged-small-chunks": lambda: SmallChunkAio(block_size=16 * 1024, intra_op_parallelism=2),
    "gds": _gds,
}


@pytest.fixture(params=sorted(KINDS))
def h(request):
    handle = KINDS[request.param]()
    yield handle
    handle.close()


def rand(numel: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g).view(dtype).cuda()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(deepnvme.cast_to_byte_tensor(a.contiguous()).cpu(),
                       deepnvme.cast_to_byte_tensor(b.contiguous()).cpu())


def test_sync_returns_one_async_returns_zero(h, tmp_path):
    t = rand(300_000)
    path = str(tmp_path / "f")
    assert h.sync_pwrite(t, path) == 1 and os.path.getsize(path) == t.nbytes
    back = torch.empty_like(t)
    assert h.sync_pread(back, path) == 1 and same(back, t)
    back.zero_()
    assert h.async_pread(back, path) == 0 and h.wait() == 1 and same(back, t)
    assert h.async_pwrite(t, str(tmp_path / "g"), ) == 0 and h.wait() == 1 and h.wait() == 0
    with open(path, "rb") as f:
        assert f.read() == t.cpu().numpy().tobytes()


def test_queue_of_ops_one_wait(h, tmp_path):
    ts = [rand(10_000 + 37 * i, seed=i) for i in range(10)]
    for i, t in enumerate(ts):
        assert h.async_pwrite(t, str(tmp_path / f"w{i}")) == 0
    assert h.wait() == len(ts)
    outs = [torch.empty_like(t) for t in ts]
    for i, o in enumerate(outs):
        h.async_pread(o, str(tmp_path / f"w{i}"))
    assert h.wait() == len(ts) and all(same(a, b) for a, b in zip(ts, outs))


def test_offsets_unaligned_sizes_and_addresses(h, tmp_path):
    ref = rand(700_001, torch.uint8)
    path = str(tmp_path / "f")
    h.sync_pwrite(ref[1:], path, 3)  # misaligned device address and file offset
    with open(path, "rb") as f:
        assert f.read()[3:] == ref[1:].cpu().numpy().tobytes()
    for off, n in [(3, 1), (4, 4095), (4095, 2), (4096, 4096), (12345, 200_000), (3, 700_000)]:
        out = torch.empty(n + 1, dtype=torch.uint8, device="cuda")[1:]
        assert h.sync_pread(out, path, off) == 1
        assert same(out, ref[1 + off - 3:1 + off - 3 + n]), (off, n)


def test_progressive_offset_writes_by_fd(h, tmp_path):
    ref = rand(1 << 17, torch.uint8)
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        pos = 0
        for part in torch.tensor_split(ref, [1000, 5000, 5001, 70_000]):
            assert h.async_pwrite(part.clone(), fd, pos) == 0 and h.wait() == 1
            pos += part.numel()
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == ref.cpu().numpy().tobytes()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_dtypes_and_zero_bytes(h, tmp_path, dtype):
    t = rand(3001, torch.uint8).bool() if dtype is torch.bool else rand(3001, dtype)
    path = str(tmp_path / "f")
    h.sync_pwrite(t, path)
    back = torch.empty_like(t)
    h.sync_pread(back, path)
    assert same(back, t)
    assert h.sync_pwrite(torch.empty(0, device="cuda"), str(tmp_path / "empty")) == 1
    assert os.path.getsize(tmp_path / "empty") == 0


def test_errors_match_the_cpu_path(h, tmp_path):
    path = str(tmp_path / "f")
    h.sync_pwrite(rand(10_000, torch.uint8), path)
    with pytest.raises(ShortTransferError) as info:
        h.sync_pread(torch.empty(5000, dtype=torch.uint8, device="cuda"), path, 6000)
    assert (info.value.path, info.value.offset, info.value.size) == (path, 6000, 5000)
    h.async_pread(torch.empty(5, dtype=torch.uint8, device="cuda"), str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundIOError):
        h.wait()
    assert h.wait() == 0
    with pytest.raises(DeepNVMeIOError):
        h.sync_pwrite(rand(10), str(tmp_path / "no" / "dir"))


def test_stream_ordering_both_ways(h, tmp_path):
    """A tensor produced by a kernel queued just before the call is written as produced, and
    data read is ready for kernels launched after wait() on any stream."""
    path = str(tmp_path / "f")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = torch.arange(4 << 20, dtype=torch.float32, device="cuda")
        torch.cuda._sleep(50_000_000)  # keep the producing stream busy
        t.mul_(3)
        h.async_pwrite(t, path)
    assert h.wait() == 1
    expected = torch.arange(4 << 20, dtype=torch.float32) * 3
    with open(path, "rb") as f:
        assert f.read() == expected.numpy().tobytes()
    back = torch.zeros_like(t)
    h.async_pread(back, path)
    h.wait()
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):
        total = back.sum()
    other.synchronize()
    assert total.item() == expected.sum().item()


def test_cuda_and_cpu_reads_agree(tmp_path):
    path = str(tmp_path / "f")
    t = rand(1 << 20)
    with deepnvme.AioHandle() as h:
        h.sync_pwrite(t, path)
        cpu = torch.empty(t.numel(), dtype=t.dtype)
        h.sync_pread(cpu, path)
    assert torch.equal(cpu.view(torch.uint8), t.cpu().view(torch.uint8))


def test_compat_builders(tmp_path):
    h = AsyncIOBuilder().load().aio_handle(1 << 20, 32, False, False, 2)
    t = rand(1000)
    assert h.sync_pwrite(t, str(tmp_path / "a")) == 1
    h.close()
    if not GDSBuilder().is_compatible():
        pytest.skip(f"cuFile unavailable: {deepnvme.gds_status().detail}")
    g = GDSBuilder().load().gds_handle(1 << 20, 32, False, False, 2)
    assert g.mode in ("nvidia-fs", "compatibility")
    buf = g.new_pinned_device_tensor(1000, t)
    buf.copy_(t)
    assert g.sync_pwrite(buf, str(tmp_path / "b")) == 1
    back = g.new_pinned_device_tensor(1000, t)
    assert g.sync_pread(back, str(tmp_path / "b")) == 1 and same(back, t)
    assert g.free_pinned_device_tensor(buf) and g.free_pinned_device_tensor(back)
    g.close()



def test_cufile_byte_counts_are_visible(tmp_path):
    """The real libcufile, called through deepnvme's counted calls: a read that runs past the end
    of the file returns its short count (the binding alone returns None), and a full read its
    size; so the mover's checks see every short transfer."""
    status = deepnvme.gds_status()
    if not status.available:
        pytest.skip(f"cuFile unavailable: {status.detail}")
    from deepnvme.handles.gds import _Driver
    from deepnvme.io.cufile import _CountedCalls
    cufile, mode = _Driver.open()
    assert isinstance(cufile, _CountedCalls), "libcufile not found: counts invisible"
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(os.urandom(10_000))
    buf = torch.empty(1 << 16, dtype=torch.uint8, device="cuda")
    fd = os.open(path, os.O_RDONLY)
    try:
        descr = cufile.Descr()
        descr.type = cufile.FileHandleType.OPAQUE_FD
        descr.handle.fd = fd
        descr.fs_ops = 0
        fh = cufile.handle_register(descr.ptr)
        try:
            assert cufile.read(fh, buf.data_ptr(), 8192, 0, 0) == 8192
            assert cufile.read(fh, buf.data_ptr(), 8192, 8192, 0) == 10_000 - 8192
        finally:
            cufile.handle_deregister(fh)
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert buf[:8192].cpu().numpy().tobytes() == f.read(8192)
