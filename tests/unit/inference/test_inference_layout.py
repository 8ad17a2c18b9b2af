"""Pure planners of the streaming layout: alignment, span merging, bounds; safetensors headers."""

import json

import pytest
import torch

from deepnvme.errors import DeepNVMeError
from deepnvme.formats.safetensors import parse_header
from deepnvme.inference._layout import BlockPlan, TensorRecord, plan_block_reads, plan_packed_block
from deepnvme.inference._safetensors import locate


def _check_plan(plan: BlockPlan, records, sizes, align=4096):
    for span in plan.spans:
        assert span.file_offset % align == 0
        assert span.buffer_offset % align == 0
        assert span.file_offset + span.nbytes <= sizes[span.file]
        assert span.buffer_offset + span.nbytes <= plan.buffer_bytes
        # an O_DIRECT-sized read unless it ends at end of file
        assert span.nbytes % align == 0 or span.file_offset + span.nbytes == sizes[span.file]
    for rec in records:
        off = plan.tensor_offsets[rec.key]
        span = next(s for s in plan.spans if s.file == rec.file
                    and s.file_offset <= rec.offset < s.file_offset + s.nbytes)
        assert off == span.buffer_offset + rec.offset - span.file_offset
        assert rec.offset + rec.nbytes <= span.file_offset + span.nbytes
        assert off % align == rec.offset % align   # dtype alignment carries over from the file


def test_contiguous_tensors_become_one_aligned_span():
    recs = [TensorRecord("a", "f", 136, 4000), TensorRecord("b", "f", 4136, 10000)]
    plan = plan_block_reads(recs, {"f": 100_000})
    assert len(plan.spans) == 1
    assert plan.spans[0].file_offset == 0 and plan.spans[0].nbytes == 16384
    assert plan.tensor_offsets == {"a": 136, "b": 4136}
    _check_plan(plan, recs, {"f": 100_000})


def test_far_apart_tensors_split_and_end_of_file_clips():
    sizes = {"f": 1_000_000, "g": 5000}
    recs = [TensorRecord("a", "f", 8, 1000), TensorRecord("b", "f", 900_000, 1000),
            TensorRecord("c", "g", 4100, 900)]
    plan = plan_block_reads(recs, sizes)
    assert len(plan.spans) == 3
    assert plan.read_bytes < 3 * 8192
    g_span = next(s for s in plan.spans if s.file == "g")
    assert g_span.file_offset == 4096 and g_span.nbytes == 5000 - 4096
    _check_plan(plan, recs, sizes)


@pytest.mark.parametrize("seed", range(20))
def test_random_layouts_keep_invariants(seed):
    g = torch.Generator().manual_seed(seed)
    recs, cursor = [], int(torch.randint(0, 9000, (1,), generator=g))
    for i in range(int(torch.randint(1, 12, (1,), generator=g))):
        n = int(torch.randint(1, 40_000, (1,), generator=g))
        recs.append(TensorRecord(f"t{i}", "f", cursor, n))
        cursor += n + int(torch.randint(0, 3, (1,), generator=g)) * int(torch.randint(0, 50_000, (1,), generator=g))
    sizes = {"f": cursor + int(torch.randint(0, 5000, (1,), generator=g))}
    plan = plan_block_reads(recs, sizes)
    _check_plan(plan, recs, sizes)
    starts = sorted((s.buffer_offset, s.buffer_offset + s.nbytes) for s in plan.spans)
    assert all(a[1] <= b[0] for a, b in zip(starts, starts[1:]))   # spans never overlap


def test_out_of_file_tensor_is_rejected():
    with pytest.raises(ValueError, match="outside"):
        plan_block_reads([TensorRecord("a", "f", 100, 50)], {"f": 120})


def test_packed_block_offsets_and_size():
    offsets, size = plan_packed_block([("a", 10), ("b", 64), ("c", 1)])
    assert offsets == {"a": 0, "b": 64, "c": 128}
    assert size == 4096
    _, size = plan_packed_block([("a", 4097)])
    assert size == 8192
    with pytest.raises(ValueError, match="twice"):
        plan_packed_block([("a", 1), ("a", 2)])


def _header(entries):
    raw = json.dumps(entries).encode()
    return raw + b" " * (-len(raw) % 8)


def test_parse_header_offsets_are_absolute():
    raw = _header({"__metadata__": {"format": "pt"},
                   "w": {"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 12]},
                   "b": {"dtype": "F32", "shape": [3], "data_offsets": [12, 24]}})
    out = locate(parse_header(raw, file="x", file_size=8 + len(raw) + 24), "x")
    assert out["w"].offset == 8 + len(raw) and out["w"].dtype == torch.bfloat16
    assert out["b"].offset == 8 + len(raw) + 12 and out["b"].shape == (3,)


@pytest.mark.parametrize("entry", [
    {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]},       # size mismatch
    {"dtype": "F32", "shape": [3], "data_offsets": [0, 1000]},    # past end of file
    {"dtype": "Q4", "shape": [3], "data_offsets": [0, 12]},       # unknown dtype
    {"dtype": "F32", "shape": [3]},                                # missing offsets
])
def test_parse_header_rejects_bad_entries(entry):
    raw = _header({"t": entry})
    with pytest.raises(DeepNVMeError, match="x"):
        parse_header(raw, file="x", file_size=8 + len(raw) + 12)


def test_parse_header_rejects_non_json():
    with pytest.raises(DeepNVMeError, match="JSON"):
        parse_header(b"{nope", file="x", file_size=100)
