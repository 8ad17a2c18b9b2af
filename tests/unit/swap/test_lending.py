"""Lending pool buffers to keys: waits when dry, deferred and refused releases, lookups."""

import threading

import pytest
import torch

from deepnvme.swap import SwapBufferError
from deepnvme.swap._lending import Lender


@pytest.fixture
def lender():
    lend = Lender(256, 2)
    yield lend
    lend.close()


def test_a_dry_pool_with_nothing_being_released_fails_at_once_naming_the_holders(lender):
    lender.lend("a", 10, None), lender.lend("b", 10, None)
    with pytest.raises(SwapBufferError, match=r"all 2 pool buffers of 256 bytes are held by "
                                              r"swapped-in keys \['a', 'b'\].*'c' \(10 bytes\)"):
        lender.lend("c", 10, None)
    with pytest.raises(SwapBufferError, match=r"'c' \(10 bytes\) after 0.01 s"):
        lender.lend("c", 10, 0.01)
    with pytest.raises(SwapBufferError, match="needs 300 bytes .* 256 bytes each"):
        lender.lend("d", 300, None)
    with pytest.raises(SwapBufferError, match=r"swap_out of key 'd'.*300 bytes.*buffer_bytes >= 300"):
        lender.check_fits("d", 300, op="swap_out")


def test_release_waits_for_the_io_using_the_buffer_and_a_waiter_gets_it(lender):
    a, _ = lender.lend("a", 10, None), lender.lend("b", 10, None)
    lender.use(a)
    assert lender.release(a) and lender.in_use == 2 and not a.returned   # deferred
    got = []
    t = threading.Thread(target=lambda: got.append(lender.lend("c", 10, None)))
    t.start()                       # waits: a's release is pending, so a buffer will come back
    t.join(0.1)
    assert t.is_alive()
    lender.done_using(a)
    t.join(5)
    assert a.returned and got[0].buffer.data_ptr() == a.buffer.data_ptr() and lender.in_use == 2


def test_reclaim_calls_off_a_deferred_release(lender):
    a = lender.lend("a", 10, None)
    lender.use(a)
    lender.release(a)
    assert lender.reclaim(a)
    lender.done_using(a)
    assert not a.returned and lender.in_use == 1
    lender.release(a)
    assert a.returned and not lender.reclaim(a)


def test_a_kept_lease_needs_force_and_wakes_a_waiter_counting_on_it(lender):
    a, _ = lender.lend("a", 10, None), lender.lend("b", 10, None)
    lender.use(a)
    lender.release(a)                                   # pending behind the write
    result = []

    def wait_for_buffer():
        try:
            result.append(lender.lend("c", 10, None))
        except SwapBufferError as exc:
            result.append(exc)

    t = threading.Thread(target=wait_for_buffer)
    t.start()
    t.join(0.1)
    lender.keep(a)                                      # the write failed: a holds the data
    t.join(5)
    assert isinstance(result[0], SwapBufferError)
    lender.done_using(a)
    assert not lender.release(a) and not a.returned
    lender.unkeep(a)
    assert lender.release(a) and a.returned


def test_find_locates_views_inside_lent_buffers(lender):
    a = lender.lend("a", 10, None)
    assert lender.find(a.buffer[100:120].view(torch.float32)) is a
    assert lender.find(a.buffer) is a
    assert lender.find(torch.zeros(4)) is None and lender.find(a.buffer[:0]) is None
    lender.release(a)
    assert lender.find(a.buffer) is None
