"""``deepnvme plan``'s Young/Daly arithmetic (no disk)."""

from __future__ import annotations

import math

import pytest

from deepnvme.bench import plan_interval


def test_young_daly_interval_and_overhead():
    p = plan_interval(checkpoint_gb=100.0, write_gbps=10.0, step_seconds=2.0, mtbf_hours=24.0)
    assert p.save_seconds == pytest.approx(10.0)
    optimum = math.sqrt(2 * 10.0 * 24 * 3600)  # 1314.5 s
    assert p.optimal_interval_seconds == pytest.approx(optimum)
    assert p.interval_steps == round(optimum / 2.0) == 657
    assert p.interval_hours == pytest.approx(657 * 2.0 / 3600)
    # at the optimum, save/T + T/(2M) = sqrt(2 C / M)
    assert p.overhead_fraction == pytest.approx(math.sqrt(2 * 10.0 / (24 * 3600)), rel=1e-4)
    assert p.rework_hours_per_failure == pytest.approx(p.interval_hours / 2)
    assert p.overlap_min_interval_steps == 5
    assert p.overlapped_overhead_fraction == pytest.approx(5 * 2.0 / (2 * 24 * 3600))


def test_interval_is_at_least_one_step_and_overlap_rounds_up():
    p = plan_interval(checkpoint_gb=1.0, write_gbps=1.0, step_seconds=1e6, mtbf_hours=1.0)
    assert p.interval_steps == 1 and p.overlap_min_interval_steps == 1
    q = plan_interval(checkpoint_gb=3.0, write_gbps=1.0, step_seconds=2.0, mtbf_hours=1.0)
    assert q.overlap_min_interval_steps == 2  # 1.5 steps of writing


@pytest.mark.parametrize("field", ["checkpoint_gb", "write_gbps", "step_seconds", "mtbf_hours"])
def test_non_positive_inputs_are_refused(field):
    kwargs = {"checkpoint_gb": 1.0, "write_gbps": 1.0, "step_seconds": 1.0, "mtbf_hours": 1.0, field: 0.0}
    with pytest.raises(ValueError, match=field):
        plan_interval(**kwargs)
