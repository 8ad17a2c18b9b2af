"""copy_bytes: parallel memmove of byte tensors, equal to Tensor.copy_."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepnvme.memory import copy as copy_mod
from deepnvme.memory.copy import copy_bytes

from ...concurrency import run_in_fork


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_copies_every_byte_of_every_pair(monkeypatch, threads):
    monkeypatch.setattr(copy_mod, "copy_threads", lambda: threads)
    monkeypatch.setattr(copy_mod, "_PIECE", 4096)  # many pieces, dealt to every thread
    g = torch.Generator().manual_seed(threads)
    sizes = [0, 1, 4095, 4096, 4097, 3 * 4096 + 17, 65536]
    srcs = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8) for n in sizes]
    dsts = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    copy_bytes(list(zip(dsts, srcs)))
    for d, s in zip(dsts, srcs):
        assert torch.equal(d, s)


def test_copies_into_views_of_one_arena(monkeypatch):
    monkeypatch.setattr(copy_mod, "_PIECE", 1000)
    arena = torch.full((10_000,), 7, dtype=torch.uint8)
    a = torch.arange(3000, dtype=torch.int64).view(torch.uint8)[:3000]
    b = torch.ones(2500, dtype=torch.uint8)
    copy_bytes([(arena[100:3100], a), (arena[5000:7500], b)])
    assert torch.equal(arena[100:3100], a) and torch.equal(arena[5000:7500], b)
    assert (arena[:100] == 7).all() and (arena[3100:5000] == 7).all() and (arena[7500:] == 7).all()


@pytest.mark.parametrize("dst,src,msg", [
    (torch.zeros(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8), "equal size"),
    (torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.int8), "uint8"),
    (torch.zeros(8, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)[::2], "contiguous"),
])
def test_rejects_mismatched_pairs(dst, src, msg):
    with pytest.raises(ValueError, match=msg):
        copy_bytes([(dst, src)])


def test_copy_threads_is_bounded():
    assert 1 <= copy_mod.copy_threads() <= 8


def test_copies_in_a_forked_child_after_the_parent_used_the_pool(monkeypatch):
    monkeypatch.setattr(copy_mod, "_PIECE", 4096)
    src = torch.arange(100_000, dtype=torch.int32).view(torch.uint8)
    dst = torch.zeros_like(src)
    copy_bytes([(dst, src)])  # the parent's pool exists now

    def child() -> bool:  # must not wait for the parent's pool threads, which it does not have
        # numpy only around the copy: torch's OpenMP pool is not usable in a forked child
        out = torch.from_numpy(np.zeros(src.numel(), dtype=np.uint8))
        copy_bytes([(out, src)])
        return np.array_equal(out.numpy(), src.numpy())

    assert run_in_fork(child) == 0

