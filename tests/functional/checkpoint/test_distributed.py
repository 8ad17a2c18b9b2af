"""Two gloo processes: FastPersist data-parallel save into one file, and DCP through the engine."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import deepnvme
from deepnvme.checkpoint.dcp import NVMeStorageReader, NVMeStorageWriter
from deepnvme.formats.torchzip import read_record_spans, split_byte_ranges, storage_spans


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(512, 300, generator=g)
    return {"w": w, "w_t": w.t(), "b": torch.randn(77, generator=g).bfloat16(),
            "big": torch.randn(400_000, generator=g), "empty": torch.zeros(0), "step": 9}


def _fastpersist(rank: int, world: int, directory: str) -> None:
    path = os.path.join(directory, "dp.pt")
    state = _state()
    deepnvme.save_distributed(state, path)
    dist.barrier()
    back = torch.load(path, weights_only=True)
    assert back["step"] == 9 and torch.equal(back["w"], state["w"]) and torch.equal(back["big"], state["big"])
    assert back["w_t"].untyped_storage().data_ptr() == back["w"].untyped_storage().data_ptr()
    assert torch.equal(deepnvme.load(path)["b"], state["b"])
    with open(path, "rb") as f:
        spans = storage_spans(read_record_spans(f, path=path, file_size=os.path.getsize(path)))
    assert all(split_byte_ranges(spans, world))  # both ranks had bytes to write
    # a rank whose replica differs makes every rank fail and keeps the previous file
    bad = _state()
    if rank == 1:
        bad["big"] = torch.zeros(10)
    with pytest.raises(deepnvme.DistributedSaveError):
        deepnvme.save_distributed(bad, path)
    dist.barrier()
    assert torch.equal(torch.load(path, weights_only=True)["big"], state["big"])
    assert sorted(os.listdir(directory)) == ["dp.pt"]
    dist.barrier()


def _spy_handle(fs) -> list:
    used = []
    real = fs.handle

    def handle():
        used.append(1)
        return real()

    fs.handle = handle
    return used


def _dcp(rank: int, world: int, directory: str) -> None:
    ckpt = os.path.join(directory, "dcp")
    # each rank owns different values under its own key plus one shared replicated tensor
    state = {f"r{rank}": torch.full((1000, 10), float(rank)), "shared": torch.arange(4096.0),
             "extra": {"lr": 0.1}}
    writer = NVMeStorageWriter(ckpt)
    used = _spy_handle(writer.fs)
    dcp.save(state, storage_writer=writer)
    assert used and writer.fs._handle is None  # the bytes went through the engine, closed on every rank
    target = {f"r{rank}": torch.zeros(1000, 10), "shared": torch.zeros(4096), "extra": {"lr": 0.0}}
    reader = NVMeStorageReader(ckpt)
    used = _spy_handle(reader.fs)
    dcp.load(target, storage_reader=reader)
    assert used and reader.fs._handle is None
    assert torch.equal(target[f"r{rank}"], torch.full((1000, 10), float(rank)))
    assert torch.equal(target["shared"], torch.arange(4096.0)) and target["extra"]["lr"] == 0.1
    stock = {f"r{rank}": torch.zeros(1000, 10), "shared": torch.zeros(4096), "extra": {"lr": 0.0}}
    dcp.load(stock, storage_reader=dcp.FileSystemReader(ckpt))  # stock DCP reads our files
    assert torch.equal(stock["shared"], torch.arange(4096.0))
    files = os.listdir(ckpt)
    assert ".metadata" in files and not [f for f in files if "deepnvme-tmp" in f]


def _worker(rank: int, world: int, port: int, directory: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=60))
    try:
        _fastpersist(rank, world, os.path.join(directory, "fp"))
        _dcp(rank, world, directory)
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes(tmp_path):
    (tmp_path / "fp").mkdir()
    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
