"""ReadsAhead: which sub-groups' state the fused update reads ahead, never taking the last pool
buffer an install needs (fakes: no disk)."""

from types import SimpleNamespace

from deepnvme.optim._ahead import ReadsAhead


class FakeSwapper:
    """Counts lent buffers as the real pool does: a read ahead takes one, release gives it."""

    def __init__(self, count):
        self.buffer_count = count
        self.lent = set()
        self.others = 0          # buffers of writes in flight

    def buffers_in_use(self):
        return len(self.lent) + self.others

    def release(self, key):
        self.lent.discard(key)


class FakeState:
    def __init__(self, n, count):
        self.subs = SimpleNamespace(layouts=[object()] * n)
        self.swapper = FakeSwapper(count)
        self.read = []

    def prefetch(self, i):
        self.read.append(i)
        self.swapper.lent.add(i)


def reads(n=8, count=3, kept=0):
    state = FakeState(n, count)
    return ReadsAhead(state, lambda: kept), state


def test_a_notice_reads_only_into_a_free_buffer_and_leaves_one_for_an_install():
    r, state = reads()
    r.notice(5)
    r.notice(5)                        # once
    r.notice(3)
    r.notice(1)                        # a third would take the last buffer
    assert state.read == [5, 3] and r.ahead == {5, 3}
    r.installing(5)
    state.swapper.others = 2           # the only free buffer is taken by writes in flight
    r.ahead.discard(3), state.swapper.release(3)
    r.notice(1)
    assert state.read == [5, 3]        # never blocks: nothing read
    state.swapper.others = 0
    r.notice(1)
    assert state.read == [5, 3, 1]


def test_failed_writes_count_and_an_install_lets_reads_ahead_go():
    r, state = reads(kept=1)
    r.notice(6)
    r.notice(4)                        # 1 ahead + 1 kept + this one: no buffer left
    assert state.read == [6]
    r.ahead.add(2), state.swapper.lent.add(2)   # a read ahead before the write failed
    r.installing(0)                    # not read ahead: 2 ahead + 1 kept hold all 3
    assert len(r.ahead) == 1 and state.swapper.buffers_in_use() == 1


def test_the_previous_steps_order_is_read_ahead_not_the_updated_ones():
    r, state = reads(count=4)
    for subs in ([6], [7], [4], [5]):  # a group's weight before its bias, as FSDP2 hands them
        r.installing(subs[0])
        r.updated(subs)
    assert state.read == [5, 3]        # no order learned: the sub-group before, if not updated
    r.end_step(completed=True)
    state.swapper.lent.clear(), state.read.clear()
    r.installing(6)
    r.updated([6])
    assert state.read == [7, 4, 5]     # the learned order, up to the buffers left
    assert 6 not in r.ahead and r.done == {6}
    r.end_step(completed=False)        # a stopped step teaches nothing
    assert r.learned == [6, 7, 4, 5] and r.ahead == set() and r.done == set()


def test_state_kept_in_memory_is_not_read():
    r, state = reads()
    state.subs.layouts = [None] * 8
    r.notice(3)
    assert state.read == [] and r.ahead == set()


def test_the_next_slices_read_leaves_the_install_a_buffer():
    """A parameter in slices (subs 3, 4): the read of slice 4 starts before slice 3's install
    takes its buffer. With one read ahead and a write in flight (which may fail and keep its
    buffer), reading 4 would leave the install none."""
    r, state = reads(count=3)
    r.notice(5)
    state.swapper.others = 1               # sub-group 6's write in flight
    assert r.installing(3) is False        # 3 was not read ahead
    assert r.start(4, wait=True, reserve=1) is False and state.read == [5]
    assert r.installing(5) is True         # read ahead: its buffer is held already
    assert r.start(4, wait=True, reserve=0) is True and state.read == [5, 4]


def test_an_install_waits_for_a_write_in_flight_before_counting_again():
    """Every buffer held (two reads ahead, a write in flight): the install would wait for the
    write's buffer, which a failing write keeps; so it waits for the write first, then counts
    again and lets a read ahead go."""
    import threading
    from concurrent.futures import Future

    failed = []
    state = FakeState(8, 3)
    write = Future()
    r = ReadsAhead(state, lambda: len(failed), lambda: [] if write.done() else [write])
    r.notice(5)
    r.notice(4)
    state.swapper.others = 1               # the write, then its kept buffer

    def fail_write():
        failed.append(1)
        write.set_exception(OSError(28, "No space left on device"))

    threading.Timer(0.05, fail_write).start()
    assert r.installing(2) is False
    assert write.done() and len(r.ahead) == 1 and state.swapper.buffers_in_use() == 2
