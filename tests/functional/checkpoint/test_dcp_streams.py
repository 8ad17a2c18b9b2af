"""The DCP file system under NVMeStorageWriter/Reader: durable streams, aborts, prefetched reads."""

from __future__ import annotations

import dataclasses
import errno
import gc
import io
import os
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

import deepnvme.checkpoint.dcp._storage as ddcp
from deepnvme.checkpoint.dcp._io import coalesce, copy_saved, parse_saved_tensor
from deepnvme.checkpoint.dcp._storage import NVMeStorageReader, NVMeStorageWriter, _EngineFileSystem
from deepnvme.config import checkpoint_config
from deepnvme.handles.aio import AioHandle
from deepnvme.io.posix import Posix


def test_write_stream_commits_on_close_and_discards_on_error(tmp_path):
    fs = _EngineFileSystem(checkpoint_config(None))
    with fs.create_stream(tmp_path / "a.bin", "wb") as s:
        s.write(b"x" * 10_000)
    assert (tmp_path / "a.bin").read_bytes() == b"x" * 10_000
    with pytest.raises(RuntimeError):
        with fs.create_stream(tmp_path / "b.bin", "wb") as s:
            s.write(b"partial")
            raise RuntimeError("serializer failed")
    with fs.create_stream(tmp_path / "empty.bin", "wb"):
        pass
    fs.close()
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "empty.bin"]


def test_coalesce_groups_neighbours_and_keeps_big_ranges_apart():
    ranges = [(5000, 100), (0, 1000), (1000, 500), (10_000_000, 50), (20_000, 40_000_000)]
    spans = coalesce(ranges, gap=4096, cap=1 << 20)
    assert [(s.start, s.end, s.members) for s in spans] == [
        (0, 5100, (1, 2, 0)), (20_000, 40_020_000, (4,)), (10_000_000, 10_000_050, (3,))]


@pytest.mark.parametrize("tensor", [
    torch.arange(24, dtype=torch.float32).reshape(4, 6),
    torch.arange(24, dtype=torch.bfloat16).reshape(4, 6).t(),  # strided
    torch.tensor(3.5, dtype=torch.float64),  # 0-d
    torch.arange(10, dtype=torch.int16)[2:7].clone(),
])
def test_parse_saved_tensor_matches_torch_load_for_slices(tensor):
    raw = io.BytesIO()
    torch.save(tensor, raw)
    blob = torch.frombuffer(bytearray(b"\0" * 3 + raw.getvalue()), dtype=torch.uint8)[3:]  # unaligned
    saved = parse_saved_tensor(blob)
    assert saved is not None and saved.dtype == tensor.dtype
    slices = [((0,) * tensor.dim(), tuple(tensor.shape))]
    if tensor.dim() == 2:
        slices += [((1, 0), (2, tensor.shape[1])), ((0, 1), (tensor.shape[0], 2)), ((2, 1), (1, 2))]
    for offsets, lengths in slices:
        target = torch.zeros(lengths, dtype=tensor.dtype)
        copy_saved(saved, offsets, lengths, target)
        expect = tensor
        for dim, (o, n) in enumerate(zip(offsets, lengths)):
            expect = expect.narrow(dim, o, n)
        assert torch.equal(target, expect)


def test_parse_saved_tensor_declines_other_objects():
    raw = io.BytesIO()
    torch.save({"a": torch.ones(2)}, raw)
    assert parse_saved_tensor(torch.frombuffer(bytearray(raw.getvalue()), dtype=torch.uint8)) is None
    assert parse_saved_tensor(torch.zeros(100, dtype=torch.uint8)) is None


class _HalfRows(DefaultLoadPlanner):
    """Reads rows [n/2, n) of each saved 2-D tensor (and whole 1-D ones): resharding's slice reads."""

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, target in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            offsets = [0] * target.dim()
            if target.dim() == 2:
                offsets[0] = md.size[0] - target.shape[0]
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=target.size())
            items += [dataclasses.replace(it, dest_index=MetadataIndex(fqn))  # a plain tensor
                      for it in create_read_items_for_chunk_list(fqn, md, [chunk])]
        return LoadPlan(items)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_slice_reading_planner_gets_the_right_bytes_from_coalesced_spans(tmp_path, monkeypatch):
    monkeypatch.setattr(ddcp, "_READ_SPAN", 64 << 10)  # several spans, some items alone
    monkeypatch.setattr(ddcp, "_READ_AHEAD", 128 << 10)
    state = {f"w{i}": torch.randn(50 + i, 40 + 30 * i) for i in range(12)}
    state["strided"] = torch.randn(64, 32).t()
    state["v"] = torch.arange(1000)
    dcp.save(state, storage_writer=NVMeStorageWriter(tmp_path / "ck", thread_count=2), no_dist=True)
    target = {k: torch.zeros(v.shape[0] - v.shape[0] // 2, *v.shape[1:], dtype=v.dtype)
              if v.dim() == 2 else torch.zeros_like(v) for k, v in state.items()}

    def no_torch_load(*args, **kwargs):
        raise AssertionError("every item here is a plain tensor: parsed, not torch.load-ed")

    monkeypatch.setattr(torch, "load", no_torch_load)
    dcp.load(target, storage_reader=NVMeStorageReader(tmp_path / "ck"), planner=_HalfRows(),
             no_dist=True)
    for k, v in state.items():
        assert torch.equal(target[k], v[v.shape[0] - target[k].shape[0]:]), k


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_truncated_data_file_raises_a_clear_error(tmp_path):
    state = {"w": torch.randn(100, 100)}
    dcp.save(state, storage_writer=NVMeStorageWriter(tmp_path / "ck"), no_dist=True)
    (data,) = [p for p in (tmp_path / "ck").iterdir() if p.suffix == ".distcp"]
    os.truncate(data, data.stat().st_size - 1000)
    with pytest.raises(CheckpointException, match="truncated"):
        dcp.load({"w": torch.zeros(100, 100)}, storage_reader=NVMeStorageReader(tmp_path / "ck"),
                 no_dist=True)


def test_write_stream_spans_many_buffers(tmp_path):
    fs = _EngineFileSystem(checkpoint_config(None))
    data = os.urandom(3 * (8 << 20) + 12345)
    with fs.create_stream(tmp_path / "big.bin", "wb") as s:
        s.write(data[:100])
        s.write(memoryview(data)[100:])
        assert s.tell() == len(data)
    fs.close()
    assert (tmp_path / "big.bin").read_bytes() == data


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_single_process_dcp_round_trip_and_stock_reader(tmp_path):
    state = {"w": torch.randn(300, 200), "b": torch.arange(10), "meta": {"epoch": 3}}
    dcp.save(state, storage_writer=NVMeStorageWriter(tmp_path / "ck"), no_dist=True)
    for reader in (NVMeStorageReader(tmp_path / "ck"), dcp.FileSystemReader(tmp_path / "ck")):
        target = {"w": torch.zeros(300, 200), "b": torch.zeros(10, dtype=torch.int64),
                  "meta": {"epoch": 0}}
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
        assert target["meta"]["epoch"] == 3


class _FullOnce(Posix):
    """The first pwritev fails with ENOSPC; later ones succeed."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def pwritev(self, fd, buffers, offset):
        if not self.failed:
            self.failed = True
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return super().pwritev(fd, buffers, offset)


def test_failed_write_stream_raises_the_oserror_and_never_writes_later(tmp_path):
    fs = _EngineFileSystem(checkpoint_config(None))
    fs._handle = AioHandle(config=fs.config, posix=_FullOnce())
    target = tmp_path / "__0_0.distcp"
    with pytest.raises(OSError) as info:
        with fs.create_stream(target, "wb") as s:
            s.write(b"x" * 200_000)
    assert info.value.errno == errno.ENOSPC and "offset" in str(info.value)
    assert os.listdir(tmp_path) == []
    s.close()  # a second close (as IOBase.__del__ does) must not retry the write
    info = None
    del s
    gc.collect()
    assert os.listdir(tmp_path) == []
    fs.close()


def test_a_write_failing_inside_torch_save_raises_the_oserror_not_the_zip_writers(tmp_path):
    # DCP writes each item with torch.save: its zip writer answers a failed write with its own
    # RuntimeError ("unexpected pos"); the stream's error is what the caller must see
    fs = _EngineFileSystem(checkpoint_config(None))
    fs._handle = AioHandle(config=fs.config, posix=_FullOnce())
    with pytest.raises(OSError) as info:
        with fs.create_stream(tmp_path / "__0_0.distcp", "wb") as s:
            for _ in range(8):  # one item after another, as DCP writes them
                torch.save(torch.randn(1 << 20), s)
    assert info.value.errno == errno.ENOSPC and "offset" in str(info.value), info.value
    assert os.listdir(tmp_path) == []
    fs.close()


def _track_handles(monkeypatch, delay: float = 0.0) -> list:
    created = []

    class Tracked(AioHandle):
        def __init__(self, *args, **kwargs):
            time.sleep(delay)  # widens the window between the check and the assignment
            super().__init__(*args, **kwargs)
            created.append(self)

    monkeypatch.setattr(ddcp, "AioHandle", Tracked)
    return created


def test_concurrent_first_use_makes_one_handle(monkeypatch):
    created = _track_handles(monkeypatch, delay=0.05)
    fs = _EngineFileSystem(checkpoint_config(None))
    start = threading.Barrier(4)
    got = []

    def use():
        start.wait()
        got.append(fs.handle())

    threads = [threading.Thread(target=use) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fs.close()
    assert len(created) == 1 and all(h is created[0] for h in got) and created[0]._closed


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_save_and_load_close_their_handles(tmp_path, monkeypatch):
    created = _track_handles(monkeypatch)
    state = {f"t{i}": torch.randn(1000) for i in range(8)}
    writer = NVMeStorageWriter(tmp_path / "ck", thread_count=4)
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert created and all(h._closed for h in created)
    n = len(created)
    target = {f"t{i}": torch.zeros(1000) for i in range(8)}
    dcp.load(target, storage_reader=NVMeStorageReader(tmp_path / "ck"), no_dist=True)
    assert len(created) > n and all(h._closed for h in created)
    assert all(torch.equal(target[k], state[k]) for k in state)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.filterwarnings("ignore:Detected an existing checkpoint")
def test_failed_metadata_commit_keeps_the_previous_metadata(tmp_path, monkeypatch):
    ckpt = tmp_path / "ck"
    dcp.save({"w": torch.full((1000,), 1.0)}, storage_writer=NVMeStorageWriter(ckpt), no_dist=True)
    before = (ckpt / ".metadata").read_bytes()

    def failing_fsync(path):
        raise OSError(errno.EIO, "Input/output error (injected fsync)")

    from deepnvme.io import durable as atomic
    monkeypatch.setattr(atomic, "fsync_path", failing_fsync)  # only the .metadata commit fsyncs by path
    with pytest.raises(CheckpointException, match="injected fsync"):
        dcp.save({"w": torch.full((1000,), 2.0)}, storage_writer=NVMeStorageWriter(ckpt), no_dist=True)
    monkeypatch.undo()
    files = sorted(os.listdir(ckpt))
    assert ".metadata" in files and ".metadata.tmp" not in files
    assert not [f for f in files if "deepnvme-tmp" in f]
    assert (ckpt / ".metadata").read_bytes() == before
    target = {"w": torch.zeros(1000)}
    dcp.load(target, storage_reader=NVMeStorageReader(ckpt), no_dist=True)
    assert torch.equal(target["w"], torch.full((1000,), 1.0))  # the previous save, whole


def _data_files(ckpt) -> list[str]:
    return sorted(f for f in os.listdir(ckpt) if f.endswith(".distcp"))


def test_overwrite_keeps_the_previous_checkpoint_until_the_new_one_is_complete(tmp_path):
    ckpt = tmp_path / "ck"
    one = {"w": torch.full((50_000,), 1.0), "b": torch.arange(7)}
    dcp.save(one, storage_writer=NVMeStorageWriter(ckpt), no_dist=True)
    first_files = _data_files(ckpt)
    writer = NVMeStorageWriter(ckpt)
    writer.fs._handle = AioHandle(config=writer.fs.config, posix=_FullOnce())
    with pytest.raises(CheckpointException, match="No space left"):
        dcp.save({"w": torch.full((50_000,), 2.0), "b": torch.arange(7) * 2},
                 storage_writer=writer, no_dist=True)
    assert _data_files(ckpt) == first_files  # the failed save wrote nothing under its names
    for reader in (NVMeStorageReader(ckpt), dcp.FileSystemReader(ckpt)):
        target = {"w": torch.zeros(50_000), "b": torch.zeros(7, dtype=torch.int64)}
        dcp.load(target, storage_reader=reader, no_dist=True)
        assert torch.equal(target["w"], one["w"]) and torch.equal(target["b"], one["b"])


def test_overwrite_replaces_the_data_files_and_removes_the_old_ones(tmp_path):
    ckpt = tmp_path / "ck"
    dcp.save({"w": torch.full((1000,), 1.0)}, storage_writer=NVMeStorageWriter(ckpt), no_dist=True)
    old = _data_files(ckpt)
    (ckpt / "__0_0.distcp").write_bytes(b"left by a stock FileSystemWriter save")
    (ckpt / "notes.txt").write_text("not DCP's")
    dcp.save({"w": torch.full((1000,), 2.0)}, storage_writer=NVMeStorageWriter(ckpt), no_dist=True)
    new = _data_files(ckpt)
    assert len(new) == len(old) and not set(new) & set(old) and "__0_0.distcp" not in new
    assert (ckpt / "notes.txt").exists()
    target = {"w": torch.zeros(1000)}
    dcp.load(target, storage_reader=dcp.FileSystemReader(ckpt), no_dist=True)
    assert torch.equal(target["w"], torch.full((1000,), 2.0))
