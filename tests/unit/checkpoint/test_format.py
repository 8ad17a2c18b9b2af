"""Pure checkpoint layout: record spans from an in-memory torch.save zip, share planning."""

from __future__ import annotations

import io

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deepnvme.formats.torchzip import (
    CheckpointFormatError,
    RecordSpan,
    batch_small_records,
    check_sizes,
    read_record_spans,
    split_by_bytes,
    split_byte_ranges,
    storage_spans,
)


def _saved(obj, alignment=64) -> bytes:
    from torch.utils.serialization import config
    buf = io.BytesIO()
    with config.patch({"save.storage_alignment": alignment}):
        torch.save(obj, buf)
    return buf.getvalue()


def test_spans_point_at_the_storage_bytes():
    a = torch.arange(10, dtype=torch.float32)
    b = torch.arange(7, dtype=torch.int16)
    raw = _saved({"a": a, "b": b, "e": torch.zeros(0)}, alignment=4096)
    spans = storage_spans(read_record_spans(io.BytesIO(raw), path="mem", file_size=len(raw)))
    found = {bytes(raw[s.offset:s.end]) for s in spans.values()}
    assert a.numpy().tobytes() in found and b.numpy().tobytes() in found and b"" in found
    assert all(s.offset % 4096 == 0 for s in spans.values())


def test_truncated_archive_is_rejected():
    raw = _saved({"a": torch.ones(1000)})
    for cut in (len(raw) - 10, len(raw) // 2, 10):
        with pytest.raises(CheckpointFormatError):
            read_record_spans(io.BytesIO(raw[:cut]), path="mem", file_size=cut)


def test_record_past_end_is_rejected():
    raw = _saved({"a": torch.ones(1000)})
    with pytest.raises(CheckpointFormatError, match="truncated"):
        read_record_spans(io.BytesIO(raw), path="mem", file_size=100)


def test_not_a_zip_is_rejected():
    with pytest.raises(CheckpointFormatError):
        read_record_spans(io.BytesIO(b"hello world" * 10), path="mem", file_size=110)


def test_check_sizes():
    spans = {"0": RecordSpan("data/0", 4096, 12)}
    check_sizes(spans, {"0": 12}, path="p")
    with pytest.raises(CheckpointFormatError):
        check_sizes(spans, {"0": 13}, path="p")
    with pytest.raises(CheckpointFormatError):
        check_sizes(spans, {"0": 12, "1": 1}, path="p")


@given(st.lists(st.integers(0, 50_000), min_size=0, max_size=12), st.integers(1, 9))
def test_byte_ranges_cover_every_byte_once_aligned(sizes, parts):
    spans, offset = {}, 4096
    for i, n in enumerate(sizes):
        spans[str(i)] = RecordSpan(f"data/{i}", offset, n)
        offset += -(-(n + 100) // 4096) * 4096
    shares = split_byte_ranges(spans, parts)
    assert len(shares) == parts
    covered: dict[str, list[tuple[int, int]]] = {}
    for share in shares:
        for p in share:
            assert p.length > 0 and p.file_offset == spans[p.key].offset + p.start
            assert p.start % 4096 == 0  # every piece starts O_DIRECT-aligned
            covered.setdefault(p.key, []).append((p.start, p.start + p.length))
    for key, span in spans.items():
        ranges = sorted(covered.get(key, []))
        pos = 0
        for lo, hi in ranges:
            assert lo == pos
            pos = hi
        assert pos == span.size


def test_byte_ranges_balance_large_storages():
    spans = {"0": RecordSpan("data/0", 4096, 100 << 20)}
    shares = split_byte_ranges(spans, 4)
    sizes = [sum(p.length for p in s) for s in shares]
    assert max(sizes) - min(sizes) <= 4096


@given(st.dictionaries(st.text(min_size=1, max_size=3), st.integers(0, 10**9), max_size=20),
       st.integers(1, 6))
def test_split_by_bytes_partitions(sizes, parts):
    groups = split_by_bytes(sizes, parts)
    assert sorted(k for g in groups for k in g) == sorted(sizes)
    assert groups == split_by_bytes(dict(reversed(list(sizes.items()))), parts)


def test_batch_small_records_groups_runs_in_file_order():
    spans = {"a": RecordSpan("data/a", 4096, 10), "b": RecordSpan("data/b", 8192, 1 << 20),
             "c": RecordSpan("data/c", (1 << 20) + 12288, 100),
             "d": RecordSpan("data/d", (1 << 20) + 16384, 0),
             "e": RecordSpan("data/e", (1 << 20) + 20480, 5000)}
    assert batch_small_records(spans) == [["a"], ["b"], ["c", "d", "e"]]
    assert batch_small_records(spans, max_batch=5000) == [["a"], ["b"], ["c", "d"], ["e"]]
    assert batch_small_records({}) == []
