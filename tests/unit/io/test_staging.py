"""The staging pipeline on CPU: a fake copier and a fake file with delays stand in for CUDA and disk."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deepnvme.errors import DeepNVMeIOError, ShortTransferError
from deepnvme.io.staging import StagingPipeline, plan_staged_chunks
from deepnvme.memory import pinned

from ...conftest import random_tensor, same_bytes
from ...fakes import FakeCopier, FakeFileIO

A = 4096


@given(size=st.integers(0, 200_000), offset=st.integers(0, 50_000),
       chunk_pages=st.integers(1, 5))
def test_plan_covers_the_request_on_aligned_boundaries(size, offset, chunk_pages):
    chunk = chunk_pages * A
    chunks = plan_staged_chunks(size, offset, chunk_bytes=chunk, alignment=A)
    assert sum(c.length for c in chunks) == size
    pos = 0
    for i, c in enumerate(chunks):
        assert c.dev_offset == pos and c.file_offset == offset + pos and c.length > 0
        assert c.slot_offset == c.file_offset % A and c.slot_offset + c.length <= chunk + A
        assert c.length <= chunk
        if i < len(chunks) - 1:
            assert (c.file_offset + c.length) % A == 0
        if 0 < i < len(chunks) - 1:
            assert c.length == chunk and c.slot_offset == 0
        pos += c.length


def test_plan_rejects_chunks_not_multiple_of_alignment():
    with pytest.raises(ValueError, match="multiple"):
        plan_staged_chunks(10, 0, chunk_bytes=A + 1, alignment=A)


def make(io, copier, *, chunk=A, buffers=2):
    return StagingPipeline(io, copier, chunk_bytes=chunk, buffers=buffers, alignment=A)


@settings(max_examples=25)
@given(size=st.integers(0, 40_000), offset=st.integers(0, 9000), buffers=st.integers(2, 4),
       lead=st.integers(0, 3))
def test_round_trip_any_size_offset_and_ring(size, offset, buffers, lead):
    io, copier = FakeFileIO(bytes(range(256)) * 40), FakeCopier()
    p = make(io, copier, buffers=buffers)
    try:
        before = bytes(io.data[:offset])
        data = random_tensor(size + lead, torch.uint8, seed=size)[lead:]
        assert p.submit(data, "f", write=True, offset=offset).result() == size
        assert bytes(io.data[offset:offset + size]) == bytes(data.numpy())
        assert bytes(io.data[:offset]) == before
        back = torch.full((size,), 7, dtype=torch.uint8)
        assert p.submit(back, "f", write=False, offset=offset).result() == size
        assert same_bytes(back, data)
        assert copier.begun == 2 and copier.active == 0 and io.active == 0
    finally:
        p.close(), io.close(), copier.close()


def test_other_dtypes_and_shapes_move_as_bytes():
    io, copier = FakeFileIO(), FakeCopier()
    p = make(io, copier)
    t = random_tensor(3 * 5000, torch.bfloat16).view(3, 5000)
    p.submit(t, "f", write=True).result()
    back = torch.empty_like(t)
    p.submit(back, "f", write=False).result()
    assert same_bytes(back, t)
    p.close(), io.close(), copier.close()


def _overlaps(a, b):
    return a[0] < b[1] and b[0] < a[1]


@pytest.mark.parametrize("write", [True, False])
def test_copies_overlap_storage_io(write):
    """6 chunks, copy and I/O 40 ms each: serial would take ~480 ms, a pipeline ~280 ms."""
    delay, n = 0.04, 6
    io, copier = FakeFileIO(bytes(n * A), delay=delay), FakeCopier(delay=delay)
    p = make(io, copier, buffers=3)
    t = random_tensor(n * A, torch.uint8)
    t0 = time.monotonic()
    p.submit(t, "f", write=write).result()
    elapsed = time.monotonic() - t0
    p.close(), io.close(), copier.close()
    assert len(copier.log) == n and len([x for x in io.log if x[3]]) == n
    serial = 2 * n * delay
    assert elapsed < 0.85 * serial, f"no overlap: {elapsed:.3f} s vs {serial:.3f} s serial"
    copies = sorted((c[2], c[3]) for c in copier.log)
    ios = sorted((x[4], x[5]) for x in io.log)
    # a chunk's copy and its own I/O never overlap (one follows the other), so any copy running
    # during any I/O is the pipeline at work: a later chunk's copy while an earlier one is
    # written, or an earlier chunk's copy while later ones are read (how far ahead depends on
    # the scheduling of the threads, so no chunk index is assumed)
    assert any(_overlaps(c, x) for c in copies for x in ios), (copies, ios)


@pytest.mark.parametrize("write", [True, False])
def test_chunk_order_and_buffer_reuse(write):
    """Each chunk's I/O and copy are ordered, and a slot is reused only after it was drained."""
    n, k = 7, 3
    io, copier = FakeFileIO(bytes((n + 1) * A), delay=0.005), FakeCopier(delay=0.003)
    p = make(io, copier, buffers=k)
    t = random_tensor(n * A + 100, torch.uint8)  # a ragged last chunk
    p.submit(t, "f", write=write).result()
    p.close(), io.close(), copier.close()
    ptrs = {c[1] for c in copier.log}
    assert len(ptrs) == k, "the ring has exactly `buffers` buffers"
    events = []  # (start, end, slot ptr, stage)
    for kind, ptr, t0, t1 in copier.log:
        events.append((t0, t1, ptr, "copy"))
    for kind, ptr, off, nbytes, t0, t1 in io.log:
        events.append((t0, t1, ptr, "io"))
    by_slot: dict[int, list] = {}
    for e in sorted(events):
        by_slot.setdefault(e[2], []).append(e)
    first, second = ("copy", "io") if write else ("io", "copy")
    for slot_events in by_slot.values():
        stages = [e[3] for e in slot_events]
        assert stages == [first, second] * (len(stages) // 2), stages  # never two users at once
        for a, b in zip(slot_events, slot_events[1:]):
            assert b[0] >= a[1] - 1e-4, "a staging buffer was reused before its last use ended"


def test_memory_is_bounded_and_freed_on_close():
    io, copier = FakeFileIO(), FakeCopier()
    p = make(io, copier, chunk=2 * A, buffers=3)
    assert p.memory_bound == 3 * 3 * A
    before = pinned.locked_bytes()
    p.submit(random_tensor(50 * A, torch.uint8), "f", write=True).result()
    grown = pinned.locked_bytes() - before
    assert 0 <= grown <= p.memory_bound
    p.close()
    assert pinned.locked_bytes() <= before
    with pytest.raises(RuntimeError, match="closed"):
        p.submit(torch.empty(1, dtype=torch.uint8), "f", write=True)
    io.close(), copier.close()


@pytest.mark.parametrize("write", [True, False])
def test_io_error_fails_the_request_and_stops_the_pipeline(write):
    n = 12
    io = FakeFileIO(bytes(n * A), delay=0.002, fail_at=2)
    copier = FakeCopier()
    p = make(io, copier, buffers=2)
    fut = p.submit(random_tensor(n * A, torch.uint8), "data.bin", write=write, offset=0)
    with pytest.raises(DeepNVMeIOError, match="fake EIO") as info:
        fut.result()
    assert info.value.path == "data.bin" and info.value.offset == 2 * A and info.value.size == A
    assert len(io.calls) <= 2 + 2, "chunks kept being submitted after the failure"
    assert io.active == 0 and copier.active == 0, "request completed with work still in flight"
    # the pipeline keeps serving later requests
    t = random_tensor(3 * A, torch.uint8)
    io.fail_at = None
    p.submit(t, "data.bin", write=True).result()
    p.close(), io.close(), copier.close()


@pytest.mark.parametrize("write", [True, False])
def test_copy_error_is_named_and_chained(write):
    io, copier = FakeFileIO(bytes(8 * A)), FakeCopier(fail_at=1)
    p = make(io, copier)
    fut = p.submit(random_tensor(5 * A, torch.uint8), "x.bin", write=write, offset=A)
    with pytest.raises(DeepNVMeIOError, match="copy failed: fake device copy failure") as info:
        fut.result()
    assert isinstance(info.value.__cause__, RuntimeError)
    assert info.value.path == "x.bin" and info.value.offset == 2 * A and info.value.size == A
    assert io.active == 0 and copier.active == 0
    p.close(), io.close(), copier.close()


def test_read_past_eof_fails_up_front(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"x" * 5000)
    io, copier = FakeFileIO(), FakeCopier()
    p = make(io, copier)
    with pytest.raises(ShortTransferError, match="read past end of file") as info:
        p.submit(torch.empty(4000, dtype=torch.uint8), str(path), write=False, offset=2000).result()
    assert (info.value.offset, info.value.size, info.value.transferred) == (2000, 4000, 0)
    assert io.calls == []
    p.close(), io.close(), copier.close()


def test_fsync_once_after_all_chunks_and_validate_per_chunk():
    io, copier = FakeFileIO(), FakeCopier()
    p = make(io, copier)
    p.submit(random_tensor(3 * A, torch.uint8), "f", write=True, validate=True, fsync=True).result()
    *chunks, last = io.calls
    assert all(c[3] and not c[4] for c in chunks) and len(chunks) == 3
    assert last == (True, 3 * A, 0, False, True)
    p.close(), io.close(), copier.close()


def test_zero_bytes_still_reach_the_engine():
    io, copier = FakeFileIO(), FakeCopier()
    p = make(io, copier)
    assert p.submit(torch.empty(0), "f", write=True, offset=7).result() == 0
    assert io.calls == [(True, 7, 0, False, False)]
    p.close(), io.close(), copier.close()


def test_close_waits_for_queued_requests():
    io, copier = FakeFileIO(delay=0.01), FakeCopier()
    p = make(io, copier)
    futs = [p.submit(random_tensor(2 * A, torch.uint8, seed=i), "f", write=True, offset=i * 2 * A)
            for i in range(4)]
    p.close()
    assert all(f.done() and f.result() == 2 * A for f in futs)
    io.close(), copier.close()


def test_begin_failure_goes_to_the_future():
    class Broken(FakeCopier):
        def begin(self, device_tensor):
            raise RuntimeError("no device")

    io, copier = FakeFileIO(), Broken()
    p = make(io, copier)
    with pytest.raises(RuntimeError, match="no device"):
        p.submit(torch.zeros(10, dtype=torch.uint8), "f", write=True).result()
    p.close(), io.close(), copier.close()
