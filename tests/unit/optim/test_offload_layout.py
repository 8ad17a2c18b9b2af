"""Pure planning of NVMe optimizer offload: sub-group partitions and packed layouts."""

import torch
from hypothesis import given
from hypothesis import strategies as st

from deepnvme.optim._layout import ALIGN, bound_bytes, partition, plan_layout


def test_partition_cuts_at_the_limit_and_never_splits_items():
    assert partition([4, 4, 4, 4], 8) == [range(0, 2), range(2, 4)]
    assert partition([4, 20, 4], 8) == [range(0, 1), range(1, 2), range(2, 3)]
    assert partition([], 8) == []
    assert partition([3, 3, 3], 100) == [range(0, 3)]


@given(st.lists(st.integers(1, 100), max_size=40), st.integers(1, 150))
def test_partition_covers_everything_in_order_within_limits(sizes, limit):
    runs = partition(sizes, limit)
    assert [i for r in runs for i in r] == list(range(len(sizes)))
    for r in runs:
        total = sum(sizes[i] for i in r)
        assert total <= limit or len(r) == 1
    for a, b in zip(runs, runs[1:]):  # greedy: the next item would not have fitted
        assert sum(sizes[i] for i in a) + sizes[b.start] > limit


def test_plan_layout_packs_aligned_entries():
    layout = plan_layout([(0, "exp_avg", torch.float32, (3, 5)), (0, "exp_avg_sq", torch.float32, (3, 5)),
                          (1, "exp_avg", torch.bfloat16, (7,))])
    offsets = [e.offset for e in layout.entries]
    assert offsets == [0, ALIGN, 2 * ALIGN]
    assert [e.nbytes for e in layout.entries] == [60, 60, 14]
    assert layout.total == 3 * ALIGN
    assert plan_layout([]).total == 0


def test_bound_bytes_matches_a_real_layout():
    numels = [15, 7, 1000]
    per_element = [(1.0, 4), (1.0, 4)]  # Adam: exp_avg and exp_avg_sq, fp32
    items = [(k, name, torch.float32, (n,)) for k, n in enumerate(numels) for name in ("a", "b")]
    assert bound_bytes(numels, per_element) == plan_layout(items).total
