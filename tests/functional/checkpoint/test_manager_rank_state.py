"""CheckpointManager's ``rank_state`` in one process, and the per-file checksums of multi-rank steps."""

from __future__ import annotations

import os

import pytest
import torch

import deepnvme
from deepnvme.checkpoint.manager._checksums import file_checksum, hasher
from deepnvme.checkpoint.manager._verify import check_step_files


def test_rank_state_is_saved_alongside_and_filled_in_place(tmp_path):
    directory = str(tmp_path / "ck")
    w = torch.arange(6.0)
    with deepnvme.CheckpointManager(directory) as mgr:
        mgr.save(1, {"w": w}, rank_state={"cursor": 3, "buf": torch.ones(2)})
        mgr.save(2, {"w": w})  # none this time
        with pytest.raises(ValueError, match="str keys"):
            mgr.save(3, {"w": w}, rank_state={0: 1})
        with pytest.raises(ValueError, match="_deepnvme_rank_state"):
            mgr.save(3, {"w": w, "_deepnvme_rank_state": 1})
    with deepnvme.CheckpointManager(directory) as mgr:
        assert "_deepnvme_rank_state" not in mgr.load(1)
        mine = {"cursor": 0, "other": "kept"}
        target = {"w": torch.zeros(6)}
        assert mgr.restore(target, step=1, rank_state=mine) == 1
        assert mine["cursor"] == 3 and torch.equal(mine["buf"], torch.ones(2)) and mine["other"] == "kept"
        assert torch.equal(target["w"], w)
        assert mgr.restore(target, step=1) == 1  # not asked for: left out, no error
        assert mgr.restore(target, step=1, strict=False, rank_state=(partial := {})) == 1
        assert partial["cursor"] == 3
        untouched = {"cursor": 9}
        assert mgr.restore(target, rank_state=untouched) == 2 and untouched == {"cursor": 9}
        with pytest.raises(ValueError, match="mutable mapping"):
            mgr.restore(target, rank_state="all")


def test_file_checksums_and_step_files(tmp_path):
    pytest.importorskip("crc32c")
    pytest.importorskip("xxhash")
    path = tmp_path / "f.bin"
    data = os.urandom(3 << 20 | 5)
    path.write_bytes(data)
    for algorithm in ("crc32c", "xxh64"):
        assert file_checksum(algorithm, str(path), chunk=1 << 20) == hasher(algorithm)(data)
    manifest = {"files": {"f.bin": len(data), "gone.bin": 3}, "checksum": "crc32c",
                "file_checksums": {"f.bin": hasher("crc32c")(data)}}
    assert check_step_files(str(tmp_path), manifest, ["f.bin"]) == []
    assert check_step_files(str(tmp_path), manifest) == ["'gone.bin' is missing, the manifest says 3"]
    flipped = bytearray(data)
    flipped[100] ^= 1
    path.write_bytes(bytes(flipped))
    assert check_step_files(str(tmp_path), manifest, ["f.bin"]) == [
        "'f.bin' fails its crc32c checksum (its bytes changed after the save)"]
    path.write_bytes(data[:10])
    assert "10 bytes, the manifest says" in check_step_files(str(tmp_path), manifest, ["f.bin"])[0]
