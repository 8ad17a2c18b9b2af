"""NVMeStorageReader's slice reads (resharding) against stock FileSystemReader on the same plan."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import deepnvme.checkpoint.dcp._read as dread
import deepnvme.checkpoint.dcp._storage as ddcp
from deepnvme.checkpoint.dcp import NVMeStorageReader, NVMeStorageWriter
from deepnvme.handles.aio import AioHandle

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Boxes(DefaultLoadPlanner):
    """Loads the box ``(offsets, sizes)`` of each saved tensor into a target of the box's size."""

    def __init__(self, boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        super().__init__()
        self.boxes = boxes

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn in self.state_dict:
            offsets, sizes = self.boxes[fqn]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            md = self.metadata.state_dict_metadata[fqn]
            items += [dataclasses.replace(it, dest_index=MetadataIndex(fqn))  # a plain tensor
                      for it in create_read_items_for_chunk_list(fqn, md, [chunk])]
        return LoadPlan(items)


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return {
        "rows": torch.randn(64, 96, generator=gen),  # 24 KiB
        "cube": torch.randn(8, 12, 20, generator=gen, dtype=torch.float64),
        "half": torch.randn(40, 33, generator=gen).to(torch.bfloat16),  # odd row bytes
        "strided": torch.randn(48, 80, generator=gen).t(),  # saved non-contiguous
        "ints": torch.arange(3000, dtype=torch.int16),
        "scalar": torch.tensor(2.5),
        "tiny": torch.arange(6, dtype=torch.int32).reshape(2, 3),
    }


_BOXES = {  # name: (offsets, sizes)
    "rows": ((16, 0), (31, 96)),  # rows: one contiguous run
    "cube": ((2, 3, 5), (4, 6, 10)),  # a box inside: strided
    "half": ((0, 11), (40, 17)),  # columns: strided
    "strided": ((10, 7), (50, 21)),
    "ints": ((1001,), (999,)),
    "scalar": ((), ()),
    "tiny": ((1, 0), (1, 3)),
}


def _targets(state, boxes, dtype=None, transpose=()):
    out = {}
    for k, (_offsets, sizes) in boxes.items():
        t = torch.full(sizes, -7, dtype=dtype or state[k].dtype)
        out[k] = t.t().contiguous().t() if k in transpose else t  # a non-contiguous target
    return out


def _expected(state, boxes):
    out = {}
    for k, (offsets, sizes) in boxes.items():
        t = state[k]
        for dim, (o, n) in enumerate(zip(offsets, sizes)):
            t = t.narrow(dim, o, n)
        out[k] = t
    return out


@pytest.fixture()
def saved(tmp_path):
    state = _state()
    dcp.save(state, storage_writer=NVMeStorageWriter(tmp_path / "ck"), no_dist=True)
    return state, tmp_path / "ck"


def _load_both(ckpt, make_targets, boxes):
    results = []
    for reader in (dcp.FileSystemReader(ckpt), NVMeStorageReader(ckpt)):
        target = make_targets()
        dcp.load(target, storage_reader=reader, planner=_Boxes(boxes), no_dist=True)
        results.append(target)
    return results


@pytest.mark.parametrize("probe_min", [1, 10_000, 1 << 40])  # every item probed, some, none
def test_slices_match_stock_reader(saved, monkeypatch, probe_min):
    state, ckpt = saved
    monkeypatch.setattr(ddcp, "PROBE_MIN", probe_min)
    stock, ours = _load_both(ckpt, lambda: _targets(state, _BOXES), _BOXES)
    expect = _expected(state, _BOXES)
    for k in _BOXES:
        assert torch.equal(stock[k], expect[k]), k  # the plan itself is right
        assert torch.equal(ours[k], stock[k]), k


def test_other_dtypes_and_non_contiguous_targets_match_stock(saved, monkeypatch):
    state, ckpt = saved
    monkeypatch.setattr(ddcp, "PROBE_MIN", 1)
    boxes = {k: v for k, v in _BOXES.items() if k not in ("scalar", "ints")}
    for make in (lambda: _targets(state, boxes, dtype=torch.float32),
                 lambda: _targets(state, boxes, transpose=("rows", "half", "strided"))):
        stock, ours = _load_both(ckpt, make, boxes)
        for k in boxes:
            assert ours[k].dtype == stock[k].dtype and torch.equal(ours[k], stock[k]), k


def test_tiny_probe_windows_fall_back_to_whole_items(saved, monkeypatch):
    state, ckpt = saved
    monkeypatch.setattr(ddcp, "PROBE_MIN", 1)
    monkeypatch.setattr(dread, "PROBE", 64)  # the central directory does not fit: read whole
    _stock, ours = _load_both(ckpt, lambda: _targets(state, _BOXES), _BOXES)
    expect = _expected(state, _BOXES)
    assert all(torch.equal(ours[k], expect[k]) for k in _BOXES)


def _count_reads(monkeypatch) -> list[int]:
    sizes: list[int] = []

    class Counting(AioHandle):
        def submit_read(self, buffer, path, *, offset=0, validate=False):
            sizes.append(buffer.nbytes)
            return super().submit_read(buffer, path, offset=offset, validate=validate)

    monkeypatch.setattr(ddcp, "AioHandle", Counting)
    return sizes


def test_half_of_large_tensors_reads_about_half_the_bytes(tmp_path, monkeypatch):
    state = {f"w{i}": torch.randn(512, 1024) for i in range(4)}  # 2 MiB each: probed
    dcp.save(state, storage_writer=NVMeStorageWriter(tmp_path / "ck"), no_dist=True)
    boxes = {k: ((0, 0), (256, 1024)) for k in state}
    sizes = _count_reads(monkeypatch)
    target = {k: torch.zeros(256, 1024) for k in state}
    dcp.load(target, storage_reader=NVMeStorageReader(tmp_path / "ck"), planner=_Boxes(boxes),
             no_dist=True)
    assert all(torch.equal(target[k], state[k][:256]) for k in state)
    half = sum(t.nbytes for t in target.values())
    assert half <= sum(sizes) <= half + 4 * 2 * dread.PROBE  # the slices and the probes only
    # a strided box: the extent from its first to its last element is read, not the item
    sizes.clear()
    box = {k: ((100, 256), (200, 512)) for k in state}
    target = {k: torch.zeros(200, 512) for k in state}
    dcp.load(target, storage_reader=NVMeStorageReader(tmp_path / "ck"), planner=_Boxes(box),
             no_dist=True)
    assert all(torch.equal(target[k], state[k][100:300, 256:768]) for k in state)
    extent = (199 * 1024 + 512) * 4
    assert 4 * extent <= sum(sizes) <= 4 * extent + 4 * 2 * dread.PROBE


def test_slice_past_the_saved_storage_raises_a_format_error(tmp_path, monkeypatch):
    state = {"w": torch.randn(64, 64)}
    dcp.save(state, storage_writer=NVMeStorageWriter(tmp_path / "ck"), no_dist=True)
    monkeypatch.setattr(ddcp, "PROBE_MIN", 1)
    real = dread.parse_layout

    def lying(head, tail, tail_start):  # the item claims a larger tensor than its storage
        layout = real(head, tail, tail_start)
        return layout and dread.TensorLayout(layout.record, layout.record_length - 4096,
                                             layout.dtype, 0, layout.size, layout.stride)

    monkeypatch.setattr(dread, "parse_layout", lying)
    with pytest.raises(CheckpointException, match="does not hold the slice"):
        dcp.load({"w": torch.zeros(64, 64)}, storage_reader=NVMeStorageReader(tmp_path / "ck"),
                 no_dist=True)
