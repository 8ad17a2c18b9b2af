"""load_into's pure planner: name matching, tied groups, routes, errors and bounce chunks."""

from __future__ import annotations

import pickle

import pytest
import torch

from deepnvme.checkpoint import _fill_plan
from deepnvme.checkpoint._fill_plan import Chunk, TargetSpec, chunks, convertible, mismatch_error, plan_fill, route
from deepnvme.errors import CheckpointMismatchError, DeepNVMeError
from deepnvme.formats.safetensors import StoredTensor


def _src(name: str, shape=(4, 3), dtype=torch.float32, offset=100, stride=None) -> StoredTensor:
    n = 1
    for d in shape:
        n *= d
    return StoredTensor(name, "f", offset, n * dtype.itemsize, dtype, tuple(shape), stride)


def _tgt(shape=(4, 3), dtype=torch.float32, contiguous=True, device="cpu", alias=None) -> TargetSpec:
    return TargetSpec(dtype, tuple(shape), contiguous, device, alias)


def test_routes():
    s = _src("a")
    assert route(_tgt(), s) == "direct"
    assert route(_tgt(device="cuda"), s) == _fill_plan.CUDA_ROUTE == "bounce"
    assert route(_tgt(device="mps"), s) == "bounce"        # no staging pipeline there: copy_
    assert route(_tgt(dtype=torch.bfloat16), s) == "bounce"
    assert route(_tgt(contiguous=False), s) == "bounce"
    assert route(_tgt(), _src("a", stride=(1, 4))) == "bounce"


def test_exact_match_plans_one_fill_per_name():
    plan = plan_fill({"a": _tgt(), "b": _tgt((2,))}, {"b": _src("b", (2,)), "a": _src("a")})
    assert [f.name for f in plan.fills] == ["a", "b"]
    assert (plan.missing, plan.unexpected, plan.mismatched) == ((), (), ())
    assert mismatch_error(plan, strict=True) is None


def test_tied_targets_are_filled_once_and_absent_twin_is_not_missing():
    targets = {"embed": _tgt(alias="w"), "x": _tgt((2,)), "head": _tgt(alias="w")}
    plan = plan_fill(targets, {"head": _src("head"), "x": _src("x", (2,))})
    assert [(f.name, f.tied) for f in plan.fills] == [("head", ("embed",)), ("x", ())]
    assert plan.missing == ()
    both = plan_fill(targets, {"head": _src("head"), "embed": _src("embed"), "x": _src("x", (2,))})
    assert [(f.name, f.tied) for f in both.fills] == [("embed", ("head",)), ("x", ())]
    assert both.unexpected == ()


def test_every_fault_is_listed_in_one_error():
    targets = {"a": _tgt(), "gone": _tgt(), "bad": _tgt((5,)), "tied1": _tgt(alias=1), "tied2": _tgt(alias=1)}
    sources = {"a": _src("a"), "bad": _src("bad", (6,)), "extra": _src("extra"), "extra2": _src("extra2")}
    plan = plan_fill(targets, sources)
    assert plan.missing == ("gone", "tied1", "tied2")
    assert plan.unexpected == ("extra", "extra2")
    assert plan.mismatched == (("bad", (6,), (5,)),)
    err = mismatch_error(plan, strict=True)
    assert isinstance(err, CheckpointMismatchError) and isinstance(err, ValueError)
    assert isinstance(err, DeepNVMeError)
    assert err.missing_keys == ["gone", "tied1", "tied2"]
    assert err.unexpected_keys == ["extra", "extra2"]
    assert err.mismatched == [("bad", (6,), (5,))]
    for word in ("'gone'", "'tied2'", "'extra2'", "'bad'", "[6]", "[5]"):
        assert word in str(err)
    again = pickle.loads(pickle.dumps(err))
    assert again.missing_keys == err.missing_keys and str(again) == str(err)


def test_strict_false_still_refuses_shape_mismatch_only():
    plan = plan_fill({"a": _tgt(), "gone": _tgt()}, {"a": _src("a"), "extra": _src("extra")})
    assert mismatch_error(plan, strict=False) is None
    bad = plan_fill({"a": _tgt((3, 4)), "gone": _tgt()}, {"a": _src("a"), "extra": _src("extra")})
    err = mismatch_error(bad, strict=False)
    assert err is not None and "size mismatch for 'a'" in str(err) and "missing" not in str(err)


def test_convertible_asks_torch():
    assert convertible(torch.bfloat16, torch.float32) and convertible(torch.complex64, torch.float32)
    assert convertible(torch.int64, torch.bool) and convertible(torch.float32, torch.float32)
    if hasattr(torch, "float4_e2m1fn_x2"):
        f4 = torch.float4_e2m1fn_x2
        assert convertible(f4, f4)
        assert not convertible(f4, torch.uint8) and not convertible(torch.float32, f4)


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="this torch has no float4_e2m1fn_x2")
def test_dtypes_copy_cannot_convert_are_refused_with_the_rest():
    f4 = torch.float4_e2m1fn_x2
    targets = {"q": _tgt((4, 3), dtype=torch.uint8), "ok": _tgt(dtype=torch.float16), "bad": _tgt((5,)),
               "gone": _tgt()}
    sources = {"q": _src("q", (4, 3), dtype=f4), "ok": _src("ok"), "bad": _src("bad", (6,))}
    plan = plan_fill(targets, sources)
    assert plan.unconvertible == (("q", f4, torch.uint8),) and [f.name for f in plan.fills] == ["ok"]
    for strict in (True, False):
        err = mismatch_error(plan, strict=strict)
        assert isinstance(err, CheckpointMismatchError)
        assert err.unconvertible == [("q", "torch.float4_e2m1fn_x2", "torch.uint8")]
        assert "cannot convert the checkpoint's torch.float4_e2m1fn_x2 to the target's torch.uint8" in str(err)
        assert "size mismatch for 'bad'" in str(err) and ("'gone'" in str(err)) == strict
    assert pickle.loads(pickle.dumps(err)).unconvertible == err.unconvertible


def test_mismatched_twin_does_not_block_the_good_one():
    plan = plan_fill({"a": _tgt(alias=7), "b": _tgt(alias=7)}, {"a": _src("a", (9,)), "b": _src("b")})
    assert [f.name for f in plan.fills] == ["b"]
    assert plan.mismatched == (("a", (9,), (4, 3)),)


@pytest.mark.parametrize("chunk_bytes", [1, 12, 24, 25, 47, 48, 10_000])
def test_chunks_tile_rows_exactly(chunk_bytes):
    s = _src("a", (4, 3))          # rows of 12 bytes at offset 100
    parts = chunks(s, chunk_bytes)
    assert parts[0].offset == 100 and sum(c.nbytes for c in parts) == 48
    rows = [c.rows for c in parts]
    assert rows[0][0] == 0 and rows[-1][1] == 4
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:]))
    assert all(c.nbytes <= max(chunk_bytes, 12) for c in parts)
    assert all(c.offset == 100 + c.rows[0] * 12 for c in parts)


def test_chunks_of_scalar_strided_and_empty_are_one_piece():
    assert chunks(_src("s", ()), 1) == [Chunk(100, 4, None)]
    strided = StoredTensor("t", "f", 8, 40, torch.float32, (2, 3), (1, 4))
    assert chunks(strided, 4) == [Chunk(8, 40, None)]
    assert chunks(_src("e", (0, 3)), 4) == [Chunk(100, 0, None)]
