"""CheckpointManager's pure rules: the interval policy and retention choice (no disk)."""

from __future__ import annotations

import pytest

from deepnvme.checkpoint.manager._policy import check_policy, is_due, retention_victims


def _due(step, *, first=False, every_steps=None, every_seconds=None, since=0.0):
    return is_due(step, first=first, every_steps=every_steps, every_seconds=every_seconds,
                  seconds_since_last=since)


def test_neither_interval_saves_every_step():
    assert all(_due(s) for s in range(5))


def test_every_steps_is_step_modulo_n():
    assert [s for s in range(10) if _due(s, every_steps=3)] == [0, 3, 6, 9]


def test_first_save_of_a_directory_is_always_due():
    assert _due(7, first=True, every_steps=5) and _due(7, first=True, every_seconds=60.0)


def test_every_seconds_counts_from_the_last_start():
    assert not _due(1, every_seconds=10.0, since=9.99)
    assert _due(1, every_seconds=10.0, since=10.0)


def test_both_intervals_either_makes_it_due():
    assert _due(4, every_steps=4, every_seconds=100.0, since=1.0)
    assert _due(5, every_steps=4, every_seconds=100.0, since=100.0)
    assert not _due(5, every_steps=4, every_seconds=100.0, since=1.0)


def test_retention_keeps_the_newest():
    assert retention_victims([5, 1, 3, 4, 2], 2) == [1, 2, 3]
    assert retention_victims([1, 2], 2) == []
    assert retention_victims([1, 2, 3], None) == []
    assert retention_victims([9], 1) == []  # the only complete checkpoint stays
    assert retention_victims([], 1) == []


@pytest.mark.parametrize("kwargs, word", [
    ({"keep": 0}, "keep"), ({"keep": 1.5}, "keep"), ({"every_steps": 0}, "every_steps"),
    ({"every_seconds": 0.0}, "every_seconds"), ({"every_seconds": float("nan")}, "every_seconds")])
def test_bad_policy_names_the_setting(kwargs, word):
    opts = {"keep": 3, "every_steps": None, "every_seconds": None, **kwargs}
    with pytest.raises(ValueError, match=word):
        check_policy(**opts)
