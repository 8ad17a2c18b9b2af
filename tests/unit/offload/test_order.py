"""OrderTracker: learns a pass's visiting order, predicts the next modules, re-learns changes."""

import pytest

from deepnvme.offload._order import OrderTracker


def run_pass(tracker, visits):
    tracker.start()
    return [tracker.visit(u) for u in visits]


def test_first_pass_predicts_nothing_then_follows_the_learned_order():
    t = OrderTracker(2)
    assert run_pass(t, [0, 1, 2, 3]) == [[], [], [], []]
    assert run_pass(t, [0, 1, 2, 3]) == [[1, 2], [2, 3], [3], []]
    assert t.learned == [0, 1, 2, 3] and t.relearned == 0


def test_repeated_consecutive_visits_count_once_and_revisits_later_count_again():
    t = OrderTracker(1)
    run_pass(t, [0, 0, 1, 0, 2])
    assert t.learned is None  # learned when the next pass starts
    assert run_pass(t, [0, 0, 1, 0, 2]) == [[1], [], [0], [2], []]
    assert t.learned == [0, 1, 0, 2]


def test_a_changed_order_stops_predicting_and_is_learned_at_the_next_pass():
    t = OrderTracker(2)
    run_pass(t, [0, 1, 2])
    assert run_pass(t, [0, 2, 1]) == [[1, 2], [], []]
    t.start()
    assert t.learned == [0, 2, 1] and t.relearned == 1
    assert t.visit(0) == [2, 1]


def test_depth_zero_never_prefetches_and_negative_depth_is_refused():
    t = OrderTracker(0)
    run_pass(t, [0, 1])
    assert run_pass(t, [0, 1]) == [[], []]
    with pytest.raises(ValueError, match="prefetch depth"):
        OrderTracker(-1)
