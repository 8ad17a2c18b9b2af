"""Pure parts of NVMeStorageReader's slice reads: layouts from probe windows, slice extents, the pool."""

from __future__ import annotations

import io

import pytest
import torch

from deepnvme.checkpoint.dcp._io import TensorLayout, parse_layout, slice_extent
from deepnvme.checkpoint.dcp._read import PROBE, SpanPool


def _saved(tensor: torch.Tensor) -> bytes:
    raw = io.BytesIO()
    torch.save(tensor, raw)
    return raw.getvalue()


def test_layout_from_head_and_tail_windows_matches_the_whole_item():
    base = torch.randn(300, 40)
    tensor = base[:, 5:25]  # a view: offset and strides of its base
    item = _saved(tensor)
    assert len(item) > 2 * PROBE
    whole = parse_layout(memoryview(item), memoryview(item), 0)
    windowed = parse_layout(memoryview(item)[:PROBE], memoryview(item)[-PROBE:], len(item) - PROBE)
    assert whole == windowed and whole is not None
    assert (whole.dtype, whole.size, whole.stride, whole.storage_offset) == (
        torch.float32, (300, 20), (40, 1), 5)
    record = item[whole.record:whole.record + whole.record_length]
    assert record == base.numpy().tobytes()  # torch.save keeps the whole storage


def test_layout_outside_the_windows_is_declined_not_guessed():
    item = memoryview(_saved(torch.randn(300, 40)))
    assert parse_layout(item[:64], item[-64:], len(item) - 64) is None  # directory not in the tail
    assert parse_layout(item[:16], item[-PROBE:], len(item) - PROBE) is None  # no local headers
    assert parse_layout(memoryview(_saved({"a": 1})), memoryview(_saved({"a": 1})), 0) is None


def _layout(size, stride, offset=0, dtype=torch.float32, record=None):
    nbytes = record if record is not None else 4 * (offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1)
    return TensorLayout(100, nbytes, dtype, offset, size, stride)


def test_slice_extent_is_first_to_last_element():
    rows = _layout((8, 16), (16, 1))
    assert slice_extent(rows, (2, 0), (3, 16)) == (2 * 16 * 4, 3 * 16 * 4)  # contiguous rows
    assert slice_extent(rows, (1, 4), (2, 8)) == ((16 + 4) * 4, (16 + 8) * 4)  # box: 2 rows' span
    assert slice_extent(rows, (0, 0), (0, 16)) == (0, 0)  # empty
    view = _layout((4, 3), (1, 4), offset=5)  # a transposed view at storage offset 5
    assert slice_extent(view, (1, 1), (2, 2)) == ((5 + 1 + 4) * 4, (1 + 4 + 1) * 4)
    assert slice_extent(_layout((), ()), (), ()) == (0, 4)  # 0-d


@pytest.mark.parametrize("offsets, lengths", [((0, 0), (9, 16)), ((0, 15), (1, 2)), ((0,), (8,))])
def test_slice_extent_refuses_reads_outside_the_tensor(offsets, lengths):
    with pytest.raises(ValueError):
        slice_extent(_layout((8, 16), (16, 1)), offsets, lengths)


def test_slice_extent_refuses_a_tensor_larger_than_its_record():
    with pytest.raises(ValueError, match="storage record"):
        slice_extent(_layout((8, 16), (16, 1), record=100), (0, 0), (8, 16))


def test_span_pool_reuses_a_bounded_number_of_aligned_buffers():
    pool = SpanPool(span=1 << 16, buffers=2)
    a, raw_a = pool.take(12345, 1000)
    b, raw_b = pool.take(4096, 1 << 16)
    assert raw_a is not None and raw_b is not None and not pool.has_room()
    assert a.data_ptr() % 4096 == 12345 % 4096 and b.data_ptr() % 4096 == 0
    c, raw_c = pool.take(0, 10)  # the pool is empty: a fresh buffer, nothing to give back
    big, raw_big = pool.take(0, (1 << 16) + 1)  # longer than a pooled buffer
    assert raw_c is None and raw_big is None and c.numel() == 10 and big.numel() == (1 << 16) + 1
    pool.give(raw_a)
    d, raw_d = pool.take(7, 20)
    assert raw_d is raw_a and d.data_ptr() % 4096 == 7
