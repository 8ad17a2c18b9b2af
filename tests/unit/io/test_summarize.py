"""summarize: the bounds and alignments of a batch's ranges, computed in bulk, equal the ones
computed range by range (pieces above ATen's grain, zero offsets and odd values included)."""

from __future__ import annotations

import pytest
import torch

from deepnvme.io.batch import summarize


def lowest_bit(values):
    return min((v & -v) if v else 1 << 62 for v in values)


@pytest.mark.parametrize("n, seed", [(1, 0), (7, 1), (128, 2), (40_000, 3)])
def test_summary_matches_a_loop(n, seed):
    g = torch.Generator().manual_seed(seed)
    at = torch.randint(0, 1 << 20, (n,), generator=g) * 512
    offsets = torch.randint(0, 1 << 24, (n,), generator=g) * torch.randint(1, 9, (n,), generator=g)
    offsets[0] = 0
    sizes = torch.randint(1, 1 << 16, (n,), generator=g)
    base = 4096 * 3 + 64
    summary, addresses, lowest, highest, absolute = summarize(at, base, offsets, sizes)
    a, o, s = at.tolist(), offsets.tolist(), sizes.tolist()
    assert addresses == [x + base for x in a] == absolute.tolist()
    assert (lowest, highest) == (min(a), max(x + y for x, y in zip(a, s)))
    assert summary.lowest == min(o) and summary.end == max(x + y for x, y in zip(o, s))
    assert (summary.smallest, summary.largest) == (min(s), max(s))
    assert summary.offset_align == lowest_bit([x | y for x, y in zip(o, s)])
    assert summary.address_align == lowest_bit(addresses)
