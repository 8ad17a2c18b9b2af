"""Batches of many small aligned reads (the gathered path: chunk ranges handed to a kernel
worker, queued and completed in bulk) keep the kernel mover's guarantees: short and
interrupted completions are resubmitted, errors name the file and offset, the first error
wins, nothing leaks, and closing with such a batch in flight ends it."""

from __future__ import annotations

import errno

import pytest
import torch

from deepnvme.errors import DeepNVMeIOError
from deepnvme.memory.views import aligned_empty

from ...conftest import open_fds, random_tensor, same_bytes
from ...fake_queues import install_faulty_queue
from ._kernel_handles import KERNEL_ENGINES, make

ENGINE_SPECIFIC = True  # each test names its engine
pytestmark = pytest.mark.skipif(not KERNEL_ENGINES, reason="no kernel engine on this system")
ITEM = 8192
COUNT = 96


def shuffled(path):
    """A file of COUNT items written in order, and a read of all of them in shuffled order
    into one aligned buffer: (expected bytes, buffer, buffer_offsets, file_offsets, sizes)."""
    data = random_tensor(COUNT * ITEM, torch.uint8)
    with open(path, "wb") as f:
        f.write(data.numpy().tobytes())
    order = torch.randperm(COUNT, generator=torch.Generator().manual_seed(1))
    expected = data.view(COUNT, ITEM)[order].reshape(-1)
    buf = aligned_empty(COUNT * ITEM)
    at = torch.arange(COUNT, dtype=torch.int64) * ITEM
    return expected, buf, at, order.to(torch.int64) * ITEM, torch.full((COUNT,), ITEM)


def test_short_and_interrupted_completions_are_resubmitted(tmp_path, monkeypatch, kernel):
    path = str(tmp_path / "f")
    expected, buf, at, offs, sizes = shuffled(path)
    queues = install_faulty_queue(monkeypatch, kernel, max_len=4096, eintr_every=7, eagain_every=11)
    with make(kernel) as h:
        n = h.read_many_into(path, buf, buffer_offsets=at, file_offsets=offs, sizes=sizes).result()
    assert n == COUNT * ITEM and same_bytes(buf, expected)
    calls = {k: sum(q.calls[k] for q in queues) for k in ("short", "eintr", "eagain")}
    assert calls["short"] >= COUNT // 2 and calls["eintr"] and calls["eagain"]


def test_read_error_names_file_and_offset_and_nothing_leaks(tmp_path, monkeypatch, kernel):
    path = str(tmp_path / "f")
    _, buf, at, offs, sizes = shuffled(path)
    install_faulty_queue(monkeypatch, kernel, fail_read_at=(COUNT // 2) * ITEM, errno_=errno.EIO)
    before = open_fds()
    with make(kernel) as h:
        with pytest.raises(DeepNVMeIOError) as info:
            h.read_many_into(path, buf, buffer_offsets=at, file_offsets=offs, sizes=sizes).result()
        # the handle goes on working after a failed batch
        good = h.read_many_into(path, buf, buffer_offsets=at[:4], file_offsets=torch.zeros(4, dtype=torch.int64),
                                sizes=sizes[:4])
        assert good.result() == 4 * ITEM
    err = info.value
    assert err.errno == errno.EIO and err.path == path and err.offset >= (COUNT // 2) * ITEM
    assert open_fds() == before


def test_close_with_a_gathered_batch_in_flight(tmp_path, kernel):
    path = str(tmp_path / "f")
    expected, buf, at, offs, sizes = shuffled(path)
    h = make(kernel, queue_depth=4, intra_op_parallelism=1)
    futures = [h.read_many_into(path, buf, buffer_offsets=at, file_offsets=offs, sizes=sizes)
               for _ in range(3)]
    h.close()  # waits for the admitted batches, then stops the worker
    assert all(f.done() for f in futures)
    assert [f.result(timeout=0) for f in futures] == [COUNT * ITEM] * 3
    assert same_bytes(buf, expected)
