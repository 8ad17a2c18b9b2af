"""read_many / write_many: many (tensor, offset) items of one file, opened once, one future."""

from __future__ import annotations

import io
import random

import pytest
import torch

import deepnvme
from deepnvme.errors import DeepNVMeIOError, ShortTransferError, UnsupportedBufferError

from ...conftest import open_fds, random_tensor, same_bytes


@pytest.fixture
def h(io_engine):
    with deepnvme.AioHandle(block_size=8192, queue_depth=8, intra_op_parallelism=2) as handle:
        assert handle.engine == io_engine
        yield handle


def test_random_aligned_reads_match_the_file(h, tmp_path):
    path = str(tmp_path / "f")
    data = random_tensor(1 << 20, torch.uint8)
    h.sync_pwrite(data, path)
    rng = random.Random(1)
    pages = [deepnvme.new_cpu_locked_tensor(4096, torch.uint8) for _ in range(600)]
    offsets = [rng.randrange(256) * 4096 for _ in pages]
    assert h.read_many(path, list(zip(pages, offsets))).result() == 600 * 4096
    assert all(same_bytes(p, data[o:o + 4096]) for p, o in zip(pages, offsets))


def test_mixed_items_any_size_offset_and_address(h, tmp_path):
    """Aligned single-chunk items (gathered), multi-chunk ones, unaligned sizes, offsets and
    addresses (bounced or buffered), all in one batch."""
    path = str(tmp_path / "f")
    data = random_tensor(300_000, torch.uint8)
    h.sync_pwrite(data, path)
    specs = [(4096, 0), (8192, 8192), (50_000, 4096), (777, 12_345), (4096, 4096 * 7),
             (100_001, 150_000), (1, 299_999), (0, 10)]
    outs = []
    for i, (n, o) in enumerate(specs):
        buf = torch.empty(n + 1, dtype=torch.uint8)[1:] if i % 2 else torch.empty(n, dtype=torch.uint8)
        outs.append((buf, o))
    assert h.read_many(path, outs).result() == sum(n for n, _ in specs)
    for (buf, o), (n, _) in zip(outs, specs):
        assert same_bytes(buf, data[o:o + n])


def test_write_many_then_read_back_and_fsync_once(h, tmp_path, monkeypatch):
    path = str(tmp_path / "f")
    parts = [random_tensor(4096 * (1 + i % 3) + (i % 2) * 100, torch.uint8, seed=i) for i in range(40)]
    offsets, pos = [], 0
    for p in parts:
        offsets.append(pos)
        pos += p.numel() + 512
    calls = []
    real_fsync = h._engine.posix.fsync
    monkeypatch.setattr(h._engine.posix, "fsync", lambda fd: (calls.append(fd), real_fsync(fd)))
    assert h.write_many(path, list(zip(parts, offsets)), fsync=True).result() == sum(p.numel() for p in parts)
    assert len(calls) == 1
    backs = [torch.empty_like(p) for p in parts]
    h.read_many(path, list(zip(backs, offsets)), validate=True).result()
    assert all(same_bytes(b, p) for b, p in zip(backs, parts))


def test_errors_name_the_item_and_the_file(h, tmp_path):
    path = str(tmp_path / "f")
    h.sync_pwrite(random_tensor(10_000, torch.uint8), path)
    with pytest.raises(ShortTransferError, match="file has 10000 bytes but the request ends at 10001"):
        h.read_many(path, [(torch.empty(4096, dtype=torch.uint8), 0),
                           (torch.empty(10, dtype=torch.uint8), 9991)]).result()
    with pytest.raises(TypeError, match=r"items\[1\] must be a \(tensor, file_offset\) pair"):
        h.read_many(path, [(torch.empty(1), 0), torch.empty(1)])
    with pytest.raises(UnsupportedBufferError, match="not contiguous"):
        h.read_many(path, [(torch.empty(4, 4).t(), 0)])
    with pytest.raises(DeepNVMeIOError, match="negative file offset"):
        h.read_many(path, [(torch.empty(4), -4)]).result()
    with pytest.raises(DeepNVMeIOError, match="No such file") as info:
        h.read_many(str(tmp_path / "missing"), [(torch.empty(4), 0)]).result()
    assert "missing" in str(info.value)
    assert h.read_many(path, []).result() == 0


def test_a_failed_batch_leaks_no_descriptor(h, tmp_path):
    before = open_fds()
    with pytest.raises(DeepNVMeIOError, match="Is a directory"):
        h.write_many(str(tmp_path), [(torch.zeros(4096, dtype=torch.uint8), 0)]).result()
    path = str(tmp_path / "f")
    h.sync_pwrite(random_tensor(8192, torch.uint8), path)
    for _ in range(50):
        with pytest.raises(ShortTransferError):
            h.read_many(path, [(torch.empty(4096, dtype=torch.uint8), 4096 * i)
                               for i in range(3)]).result()
    assert open_fds() == before


def test_buffers_are_released_before_the_future_completes(tmp_path, io_engine):
    """A caller woken by the future may resize the memory at once (a BytesIO's export): no
    worker still references the items' tensors (this raced when they were released later)."""
    stream = io.BytesIO(b"x" * 8192)
    path = str(tmp_path / "f")
    with deepnvme.AioHandle(engine=io_engine) as h:
        for i in range(200):
            view = stream.getbuffer()
            data = torch.frombuffer(view, dtype=torch.uint8)
            single = torch.frombuffer(view, dtype=torch.uint8)
            h.write_many(path, [(data, 0)], fsync=False).result()
            h.submit_write(single, path, offset=0).result()
            del data, single, view
            stream.write(b"y")  # BufferError if any export of the buffer is still alive


def test_read_many_into_one_buffer_from_offset_tensors(h, tmp_path):
    """Ranges given as three integer tensors land in one buffer: aligned pages (gathered), a
    multi-chunk range, and unaligned sizes and offsets, in one call; the kept-open file too."""
    path = str(tmp_path / "f")
    data = random_tensor(300_000, torch.uint8)
    h.sync_pwrite(data, path)
    rng = random.Random(2)
    file_offsets = [rng.randrange(70) * 4096 for _ in range(200)] + [4096, 12_345, 299_999]
    sizes = [4096] * 200 + [50_000, 777, 1]
    buffer_offsets, at = [], 0
    for n in sizes:
        buffer_offsets.append(at)
        at += -(-n // 4096) * 4096
    buf = deepnvme.new_cpu_locked_tensor(at, torch.uint8)
    for keep_open in (False, True):
        buf.zero_()
        got = h.read_many_into(path, buf, buffer_offsets=torch.tensor(buffer_offsets),
                               file_offsets=torch.tensor(file_offsets, dtype=torch.int32),
                               sizes=torch.tensor(sizes), keep_open=keep_open).result()
        assert got == sum(sizes)
        assert all(same_bytes(buf[b:b + n], data[o:o + n])
                   for b, o, n in zip(buffer_offsets, file_offsets, sizes))
    h.close_files([path])
    none = torch.zeros(0, dtype=torch.int64)
    assert h.read_many_into(path, buf, buffer_offsets=none, file_offsets=none, sizes=none).result() == 0


def test_read_many_into_errors_name_the_range_and_the_file(h, tmp_path):
    path = str(tmp_path / "f")
    h.sync_pwrite(random_tensor(10_000, torch.uint8), path)
    buf = torch.empty(8192, dtype=torch.uint8)
    with pytest.raises(ShortTransferError, match=r"file has 10000 bytes but the request ends at 12288") as info:
        h.read_many_into(path, buf, buffer_offsets=torch.tensor([0, 4096]), file_offsets=torch.tensor([0, 8192]),
                         sizes=torch.tensor([4096, 4096])).result()
    assert path in str(info.value) and "8192" in str(info.value)
    with pytest.raises(ValueError, match=r"range 1 \(4097 bytes at buffer byte 4096\) lies outside the 8192-byte"):
        h.read_many_into(path, buf, buffer_offsets=torch.tensor([0, 4096]), file_offsets=torch.tensor([0, 0]),
                         sizes=torch.tensor([4096, 4097]))
    with pytest.raises(ValueError, match="differ in length: 2, 1, 2"):
        h.read_many_into(path, buf, buffer_offsets=torch.tensor([0, 1]), file_offsets=torch.tensor([0]),
                         sizes=torch.tensor([1, 1]))
    with pytest.raises(UnsupportedBufferError, match="not contiguous"):
        h.read_many_into(path, torch.empty(64, 64, dtype=torch.uint8).t(), buffer_offsets=torch.tensor([0]),
                         file_offsets=torch.tensor([0]), sizes=torch.tensor([1]))
    with pytest.raises(DeepNVMeIOError, match="negative file offset"):
        h.read_many_into(path, buf, buffer_offsets=torch.tensor([0]), file_offsets=torch.tensor([-4096]),
                         sizes=torch.tensor([4096])).result()
