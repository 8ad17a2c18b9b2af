"""Batches of many small aligned writes (``write_many``) take the gathered path too: their
chunks reach a kernel worker as index ranges, queued by one ``prep_many`` and completed in
bulk. The kernel mover's guarantees hold for them as for reads: short and interrupted
completions are resubmitted, an error names the file and offset, the first error wins,
nothing leaks."""

from __future__ import annotations

import errno

import pytest
import torch

import deepnvme
from deepnvme.config import IOConfig
from deepnvme.errors import DeepNVMeIOError, ValidationError
from deepnvme.io import kernel as kernel_mod
from deepnvme.io.posix import Posix
from deepnvme.memory.views import aligned_empty

from ...conftest import open_fds, random_tensor
from ...fake_queues import install_faulty_queue
from .test_gathered_faults import COUNT, ITEM, KERNEL_ENGINES, make

ENGINE_SPECIFIC = True  # each test names its engine
pytestmark = pytest.mark.skipif(not KERNEL_ENGINES, reason="no kernel engine on this system")


def items(path):
    """COUNT aligned ITEM-byte buffers to write in shuffled file order over an existing file
    of zeros: (items, the file's expected bytes)."""
    with open(path, "wb") as f:
        f.write(bytes(COUNT * ITEM))
    data = random_tensor(COUNT * ITEM, torch.uint8)
    buf = aligned_empty(COUNT * ITEM)
    buf.copy_(data)
    order = torch.randperm(COUNT, generator=torch.Generator().manual_seed(2)).tolist()
    batch = [(buf[i * ITEM:(i + 1) * ITEM], order[i] * ITEM) for i in range(COUNT)]
    expected = bytearray(COUNT * ITEM)
    for i, block in enumerate(order):
        expected[block * ITEM:(block + 1) * ITEM] = data[i * ITEM:(i + 1) * ITEM].numpy().tobytes()
    return batch, bytes(expected)


@pytest.fixture
def ranges(monkeypatch):
    """Counts the chunks queued through start_range (the gathered path)."""
    seen = {"ranged": 0}
    real = kernel_mod._Worker.start_range

    def start_range(self, op, start, stop):
        nxt = real(self, op, start, stop)
        seen["ranged"] += nxt - start
        return nxt

    monkeypatch.setattr(kernel_mod._Worker, "start_range", start_range)
    return seen


def test_small_writes_go_as_ranges_and_short_or_interrupted_ones_are_resubmitted(
        tmp_path, monkeypatch, kernel, ranges):
    path = str(tmp_path / "f")
    batch, expected = items(path)
    queues = install_faulty_queue(monkeypatch, kernel, max_len=4096, eintr_every=7, eagain_every=11)
    with make(kernel) as h:
        assert h.write_many(path, batch).result() == COUNT * ITEM
    with open(path, "rb") as f:
        assert f.read() == expected
    assert ranges["ranged"] >= COUNT  # every item went through the range path
    calls = {k: sum(q.calls[k] for q in queues) for k in ("short", "eintr", "eagain")}
    assert calls["short"] >= COUNT // 2 and calls["eintr"] and calls["eagain"]


def test_write_error_names_file_and_offset_and_nothing_leaks(tmp_path, monkeypatch, kernel):
    path = str(tmp_path / "f")
    batch, _ = items(path)
    install_faulty_queue(monkeypatch, kernel, fail_write_at=(COUNT // 2) * ITEM,
                         errno_=errno.ENOSPC)
    before = open_fds()
    with make(kernel) as h:
        with pytest.raises(DeepNVMeIOError) as info:
            h.write_many(path, batch).result()
        # the handle goes on working after a failed batch
        assert h.write_many(path, [(t, 0) for t, _ in batch[:4]]).result() == 4 * ITEM
    err = info.value
    assert err.errno == errno.ENOSPC and err.path == path
    assert err.offset >= (COUNT // 2) * ITEM
    assert open_fds() == before


def test_close_with_gathered_writes_in_flight(tmp_path, kernel):
    path = str(tmp_path / "f")
    batch, expected = items(path)
    h = make(kernel, queue_depth=4, intra_op_parallelism=1)
    futures = [h.write_many(path, batch) for _ in range(3)]
    h.close()  # waits for the admitted batches, then stops the worker
    assert [f.result(timeout=0) for f in futures] == [COUNT * ITEM] * 3
    with open(path, "rb") as f:
        assert f.read() == expected


class CorruptsReadBack(Posix):
    """Validation reads (buffered ``read_fully``) see one bit flipped at offset ``at``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def read_fully(self, fd, view, offset, *, path=None):
        n = super().read_fully(fd, view, offset, path=path)
        if offset == self.at:
            view[0] ^= 1
        return n


def test_validated_batches_are_gathered_and_each_item_is_checked(tmp_path, kernel, ranges):
    path = str(tmp_path / "f")
    batch, expected = items(path)
    with make(kernel) as h:
        assert h.write_many(path, batch, validate=True).result() == COUNT * ITEM
        back = [(aligned_empty(ITEM, min_bytes=0), off) for _, off in batch]
        assert h.read_many(path, back, validate=True).result() == COUNT * ITEM
    assert ranges["ranged"] >= 2 * COUNT  # both batches on the range path
    assert all(b.numpy().tobytes() == t.numpy().tobytes() for (b, _), (t, _) in zip(back, batch))
    bad = batch[COUNT // 3][1]
    h = deepnvme.AioHandle(config=IOConfig(block_size=1 << 20, queue_depth=8,
                                           intra_op_parallelism=2, engine=kernel),
                           posix=CorruptsReadBack(bad))
    with h, pytest.raises(ValidationError, match="differ") as info:
        h.write_many(path, batch, validate=True).result()
    assert info.value.path == path and info.value.offset == bad and info.value.size == ITEM
