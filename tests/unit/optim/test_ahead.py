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
