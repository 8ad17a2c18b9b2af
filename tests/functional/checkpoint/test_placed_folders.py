"""Folders of several files on a Volume: each file whole on one drive, balanced by bytes, read
by stock readers where it lies and by deepnvme through the volume; missing drives named."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import deepnvme
from deepnvme import Volume, VolumeLayoutError
from deepnvme.checkpoint._placed import PLACEMENT_NAME, assign
from deepnvme.checkpoint._sharded import shard_groups

from ...conftest import same_bytes


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    sizes = [70_000, 9_000, 41_000, 41_000, 5_000, 30_000, 12_000]
    out = {f"layer{i}.w": torch.randn(n // 4, generator=g) for i, n in enumerate(sizes)}
    out["ids"] = torch.arange(1000, dtype=torch.int64)
    out["half"] = torch.randn(3, 333, generator=g).to(torch.bfloat16)
    return out


def test_assign_is_largest_first_to_the_least_filled_drive():
    assert assign({"a": 10, "b": 7, "c": 5, "d": 4}, 2) == {"a": 0, "b": 1, "c": 1, "d": 0}
    assert assign({"x": 1}, 3, used=[5, 0, 2]) == {"x": 1}
    assert shard_groups([("a", 4), ("b", 4), ("c", 9), ("d", 1)], 8) == [["a", "b"], ["c"], ["d"]]


def test_sharded_safetensors_on_a_volume(tmp_path):
    vol = Volume([tmp_path / "d0", tmp_path / "d1"])
    tensors = _tensors()
    written = deepnvme.save_safetensors_sharded(tensors, vol / "ckpt", max_shard_size=60_000,
                                                metadata={"format": "pt"})
    folders = [tmp_path / "d0" / "ckpt", tmp_path / "d1" / "ckpt"]
    per_drive = [sorted(f for f in os.listdir(d) if f.endswith(".safetensors")) for d in folders]
    assert all(per_drive) and not set(per_drive[0]) & set(per_drive[1])
    assert sorted(per_drive[0] + per_drive[1]) == sorted(os.path.basename(p) for p in written)
    loads = [sum(os.path.getsize(d / f) for f in fs) for d, fs in zip(folders, per_drive)]
    assert max(loads) - min(loads) <= max(t.nbytes for t in tensors.values()) + 8192
    index = json.loads((folders[0] / "model.safetensors.index.json").read_text())
    record = json.loads((folders[0] / PLACEMENT_NAME).read_text())
    assert set(record["files"]) == set(index["weight_map"].values())
    # stock safetensors reads each shard on its drive; together they are the whole dict
    stock: dict[str, torch.Tensor] = {}
    for path in written:
        with safe_open(path, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
        stock.update(load_file(path))
    assert stock.keys() == tensors.keys() and all(same_bytes(stock[k], tensors[k]) for k in tensors)
    back = deepnvme.load_safetensors(vol / "ckpt")
    assert back.keys() == tensors.keys() and all(same_bytes(back[k], tensors[k]) for k in tensors)
    # gathered into one folder, stock readers of a folder read it
    names = deepnvme.gather_folder(vol / "ckpt", tmp_path / "joined")
    assert "model.safetensors.index.json" in names and PLACEMENT_NAME not in names
    joined = deepnvme.load_safetensors(tmp_path / "joined")
    assert all(same_bytes(joined[k], tensors[k]) for k in tensors)


def test_resave_replaces_the_old_shards_on_every_drive(tmp_path):
    vol = Volume([tmp_path / "d0", tmp_path / "d1", tmp_path / "d2"])
    tensors = _tensors()
    deepnvme.save_safetensors_sharded(tensors, vol, max_shard_size=50_000)
    small = {"only": torch.ones(10)}
    written = deepnvme.save_safetensors_sharded(small, vol, max_shard_size=50_000)
    assert [os.path.basename(p) for p in written] == ["model.safetensors"]
    left = [f for d in vol.paths for f in os.listdir(d) if f.endswith((".safetensors", ".json"))]
    assert sorted(left) == ["deepnvme-placement.json", "model.safetensors"]
    assert torch.equal(deepnvme.load_safetensors(vol)["only"], small["only"])


def test_plain_folder_is_readable_by_stock_and_deepnvme(tmp_path):
    tensors = _tensors()
    deepnvme.save_safetensors_sharded(tensors, tmp_path / "plain", max_shard_size=80_000)
    assert not (tmp_path / "plain" / PLACEMENT_NAME).exists()
    back = deepnvme.load_safetensors(tmp_path / "plain")
    assert all(same_bytes(back[k], tensors[k]) for k in tensors)


def test_missing_drive_or_shard_is_named(tmp_path):
    vol = Volume([tmp_path / "d0", tmp_path / "d1"])
    deepnvme.save_safetensors_sharded(_tensors(), vol / "c", max_shard_size=60_000)
    shutil.move(tmp_path / "d1", tmp_path / "gone")
    with pytest.raises(VolumeLayoutError, match=r"volume drive 1 \(.*d1/c\) should hold .*"
                                                r"folder does not exist"):
        deepnvme.load_safetensors(vol / "c")
    shutil.move(tmp_path / "gone", tmp_path / "d1")
    victim = next(f for f in os.listdir(tmp_path / "d1" / "c") if f.endswith(".safetensors"))
    os.unlink(tmp_path / "d1" / "c" / victim)
    with pytest.raises(VolumeLayoutError, match=f"should hold '{victim}': the file is missing"):
        deepnvme.load_safetensors(vol / "c")
    with pytest.raises(VolumeLayoutError, match="placed on 2 drives"):
        deepnvme.load_safetensors(Volume([tmp_path / "d0", tmp_path / "d1", tmp_path / "d2"]) / "c")
    with pytest.raises(VolumeLayoutError, match="drive 0 has no folder"):
        deepnvme.load_safetensors(vol / "nothing")


def test_load_of_placed_torch_shards(tmp_path):
    vol = Volume([tmp_path / "d0", tmp_path / "d1"])
    parts = {"pytorch_model-1.bin": {"a": torch.arange(10)}, "pytorch_model-2.bin": {"b": torch.ones(3)}}
    os.makedirs(tmp_path / "d0" / "m")
    os.makedirs(tmp_path / "d1" / "m")
    for drive, (name, sd) in enumerate(parts.items()):
        torch.save(sd, tmp_path / f"d{drive}" / "m" / name)
    (tmp_path / "d0" / "m" / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {"a": "pytorch_model-1.bin", "b": "pytorch_model-2.bin"}}))
    from deepnvme.checkpoint._placed import write_placement
    write_placement([str(tmp_path / "d0" / "m"), str(tmp_path / "d1" / "m")],
                    {"pytorch_model-1.bin": 0, "pytorch_model-2.bin": 1})
    back = deepnvme.load(vol / "m")
    assert torch.equal(back["a"], parts["pytorch_model-1.bin"]["a"]) and torch.equal(back["b"], torch.ones(3))


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {f"w{i}": torch.randn(n, generator=g) for i, n in enumerate([40_000, 3_000, 25_000, 25_000,
                                                                         9_000, 17_000, 1_000, 30_000])}


def test_dcp_save_on_a_volume_places_files_and_reads_back(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from deepnvme.checkpoint.dcp import NVMeStorageReader, NVMeStorageWriter

    vol = Volume([tmp_path / "d0", tmp_path / "d1"])
    state = _state()
    dcp.save(state, storage_writer=NVMeStorageWriter(vol / "step", thread_count=4), no_dist=True)
    folders = [tmp_path / "d0" / "step", tmp_path / "d1" / "step"]
    data = [sorted(f for f in os.listdir(d) if f.endswith(".distcp")) for d in folders]
    assert len(data[0]) == 2 and len(data[1]) == 2, data
    sizes = [sum(os.path.getsize(d / f) for f in fs) for d, fs in zip(folders, data)]
    assert abs(sizes[0] - sizes[1]) < 0.25 * sum(sizes)
    assert (folders[0] / ".metadata").exists() and not (folders[1] / ".metadata").exists()
    record = json.loads((folders[0] / PLACEMENT_NAME).read_text())["files"]
    assert {n: d for d in (0, 1) for n in data[d]} == record
    back = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(back, storage_reader=NVMeStorageReader(vol / "step"), no_dist=True)
    assert all(same_bytes(back[k], state[k]) for k in state)
    # a second save replaces the first on every drive
    state2 = {k: v + 1 for k, v in state.items()}
    dcp.save(state2, storage_writer=NVMeStorageWriter(vol / "step", thread_count=4), no_dist=True)
    assert sum(len([f for f in os.listdir(d) if f.endswith(".distcp")]) for d in folders) == 4
    # stock dcp.load reads the folder gathered into one directory
    deepnvme.gather_folder(vol / "step", tmp_path / "joined")
    stock = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(stock, storage_reader=dcp.FileSystemReader(tmp_path / "joined"))
    assert all(same_bytes(stock[k], state2[k]) for k in state)
    # a missing drive is named
    shutil.move(tmp_path / "d1", tmp_path / "gone")
    with pytest.raises(CheckpointException) as info:
        dcp.load(back, storage_reader=NVMeStorageReader(vol / "step"), no_dist=True)
    inner = info.value.failures[0][0]  # DCP wraps each rank's error with its traceback
    assert isinstance(inner, VolumeLayoutError)
    assert re.search(r"volume drive 1 \(.*d1/step\) should hold '__0_.*distcp'.*not mounted", str(inner))


def _dcp_rank(rank: int, world: int, port: int, root: str) -> None:
    import datetime

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    from deepnvme.checkpoint.dcp import NVMeStorageReader, NVMeStorageWriter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        vol = Volume([os.path.join(root, "d0"), os.path.join(root, "d1")])
        # rank 0 holds four times rank 1's bytes: one drive each would be unbalanced
        state = {f"r{rank}.{i}": torch.full((25_000 * (4 if rank == 0 else 1),), float(rank + i))
                 for i in range(2)}
        dcp.save(state, storage_writer=NVMeStorageWriter(vol / "s", thread_count=2))
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(back, storage_reader=NVMeStorageReader(vol / "s"))
        assert all(torch.equal(back[k], state[k]) for k in state)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_dcp_volume_balances_every_ranks_files(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_dcp_rank, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    sizes = [sum(os.path.getsize(tmp_path / d / "s" / f) for f in os.listdir(tmp_path / d / "s")
                 if f.endswith(".distcp")) for d in ("d0", "d1")]
    # files 400k, 400k (rank 0) and 100k, 100k (rank 1): 500k on each drive
    assert abs(sizes[0] - sizes[1]) < 20_000, sizes


def test_cli_volume_gather(tmp_path, capsys):
    from deepnvme.cli.main import main

    tensors = _tensors()
    drives = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    deepnvme.save_safetensors_sharded(tensors, Volume(drives) / "m", max_shard_size=60_000)
    assert main(["volume", "gather", "m", str(tmp_path / "out"), "--drives", *drives]) == 0
    assert "gathered" in capsys.readouterr().out
    stock: dict[str, torch.Tensor] = {}
    for name in os.listdir(tmp_path / "out"):
        if name.endswith(".safetensors"):
            stock.update(load_file(tmp_path / "out" / name))
    assert stock.keys() == tensors.keys() and all(same_bytes(stock[k], tensors[k]) for k in tensors)
    assert main(["volume", "gather", "m", str(tmp_path / "out2"), "--drives", drives[0]]) != 0
