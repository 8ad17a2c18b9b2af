"""The staging arena pool shared by the snapshot and fenced stagers (host memory only)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from deepnvme.checkpoint._arena import ArenaPool, arena_bytes


def test_arena_bytes_rounds_each_storage_up_to_a_page():
    assert arena_bytes([]) == 0
    assert arena_bytes([1, 4096, 4097, 0]) == 4096 + 4096 + 8192


def test_an_arena_is_reused_and_replaced_only_when_too_small():
    pool = ArenaPool(1)
    first = pool.take(10_000)
    ptr = first.tensor.data_ptr()
    first.release()
    first.release()  # idempotent
    again = pool.take(5000)
    assert again.tensor.data_ptr() == ptr  # fits: reused
    again.release()
    bigger = pool.take(1 << 20)
    assert bigger.tensor.numel() >= 1 << 20
    bigger.release()
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.take(1)


def test_grow_keeps_the_bytes_already_copied():
    pool = ArenaPool(1)
    lease = pool.take(4096)
    want = (torch.arange(4096) % 251).to(torch.uint8)
    lease.tensor[:4096] = want
    grown = lease.grow(1 << 16, keep=4096)
    assert grown.numel() >= 1 << 16 and torch.equal(grown[:4096], want)
    assert pool.arenas()[0] is grown
    lease.release()
    pool.close()


def test_take_waits_for_a_free_arena_and_counts_the_wait():
    pool = ArenaPool(1)
    held = pool.take(4096)
    assert pool.busy()
    threading.Timer(0.3, held.release).start()
    start = time.monotonic()
    pool.take(4096).release()
    assert time.monotonic() - start >= 0.25 and pool.wait_seconds >= 0.25
    pool.close()


def test_an_allocated_arena_is_preferred_and_the_count_is_checked():
    pool = ArenaPool(2)
    a = pool.take(4096)
    a.release()
    b = pool.take(4096)
    assert b.tensor.data_ptr() == a.tensor.data_ptr() and pool.arenas()[1] is None
    b.release()
    pool.close()
    assert pool.arenas() == [None, None]
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="arenas must be an int >= 1"):
            ArenaPool(bad)  # type: ignore[arg-type]
