"""How many completions a kernel worker waits for per system call: a share of its chunks in
flight for large transfers (one return to Python per several chunks), as the mover says."""

from __future__ import annotations

import pytest
import torch

import deepnvme

from ...conftest import random_tensor, same_bytes
from ...fake_queues import FaultyQueue, install_faulty_queue
from ._kernel_handles import KERNEL_ENGINES, make

ENGINE_SPECIFIC = True  # each test names its engine (the ``kernel`` fixture)
pytestmark = pytest.mark.skipif(not KERNEL_ENGINES, reason="no kernel engine on this system")


class RecordingQueue(FaultyQueue):
    """A real queue that records the completions each call waits for: the chunk worker's
    (``submit_and_wait``) and small reads' (``submit_wait``) apart."""

    def __init__(self, inner, **faults):
        super().__init__(inner, **faults)
        self.waits: list[int] = []
        self.small_waits: list[int] = []

    def submit_and_wait(self, wait, single=False):
        self.waits.append(wait)
        return super().submit_and_wait(wait, single)

    def submit_wait(self, wait, most=0):
        self.small_waits.append(wait)
        events = FaultyQueue.submit_and_wait(self, wait, most == 1)
        return [t for t, _ in events], [r for _, r in events]


def test_large_transfers_wait_for_a_share_of_the_queue(tmp_path, monkeypatch, kernel):
    queues = install_faulty_queue(monkeypatch, kernel, RecordingQueue)
    depth = 32
    with make(kernel, block_size=64 << 10, queue_depth=depth, intra_op_parallelism=1) as h:
        t = deepnvme.new_cpu_locked_tensor(8 << 20, torch.uint8)  # 128 chunks
        t.copy_(random_tensor(8 << 20, torch.uint8))
        path = str(tmp_path / "f")
        h.sync_pwrite(t, path)
        back = deepnvme.new_cpu_locked_tensor(8 << 20, torch.uint8)
        h.sync_pread(back, path)
    assert same_bytes(back, t)
    share = queues[0].inner.wait_share
    waits = [w for q in queues for w in q.waits]
    assert share > 1 and max(waits) == depth // share
    # a full queue's worth waited for at a time: far fewer calls than chunks (2 x 128)
    assert len(waits) < 2 * 128 // 2


def test_small_reads_wait_as_their_queue_says(tmp_path, monkeypatch, kernel):
    queues = install_faulty_queue(monkeypatch, kernel, RecordingQueue)
    data = random_tensor(1 << 20, torch.uint8)
    path = tmp_path / "f"
    path.write_bytes(data.numpy().tobytes())
    buf = deepnvme.new_cpu_locked_tensor(200 * 4096, torch.uint8)
    offsets = torch.tensor([(i * 7 % 256) * 4096 for i in range(200)])
    with make(kernel, queue_depth=32, intra_op_parallelism=1) as h:
        h.read_many_into(str(path), buf, buffer_offsets=torch.arange(200) * 4096, file_offsets=offsets,
                         sizes=torch.full((200,), 4096)).result()
    for i, off in enumerate(offsets.tolist()):
        assert same_bytes(buf[i * 4096:(i + 1) * 4096], data[off:off + 4096])
    waits = [w for q in queues for w in q.small_waits]
    share = queues[0].inner.small_wait_share
    assert waits and max(waits) == max(1, 32 // share)
