"""CheckpointManager on a Volume (one process): each step's state.pt whole on one drive, balanced
by bytes, read by plain torch.load where it lies; retention, leftovers, a lost file and a volume
reopened with another layout, across the drives."""

from __future__ import annotations

import errno
import json
import os
import shutil

import pytest
import torch

import deepnvme
from deepnvme import CheckpointCorruptError, Volume, VolumeLayoutError
from deepnvme.cli.main import main
from deepnvme.io.posix import injected

from .test_manager import _FullDisk

STEP = "step-{:012d}"


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}


def _drive_of(tmp_path, step: int) -> int:
    """The drive whose folder holds ``step``'s state.pt (exactly one does)."""
    found = [d for d in (0, 1) if (tmp_path / f"d{d}" / "ckpts" / STEP.format(step) / "state.pt").is_file()]
    assert len(found) == 1, found
    return found[0]


def _saved(tmp_path, steps, *, keep=None, vol=None):
    vol = vol or Volume([tmp_path / "d0", tmp_path / "d1"])
    states = {}
    with deepnvme.CheckpointManager(vol / "ckpts", keep=keep, rng=False) as mgr:
        for step in steps:
            states[step] = _state(step)
            mgr.save(step, {"model": states[step]})
            mgr.wait()
    return vol, states


def test_steps_alternate_drives_and_plain_torch_load_reads_each_file(tmp_path):
    vol, states = _saved(tmp_path, [1, 2, 3, 4])
    assert [_drive_of(tmp_path, s) for s in (1, 2, 3, 4)] == [0, 1, 0, 1]
    home = tmp_path / "d0" / "ckpts"
    for step, state in states.items():
        manifest = json.loads((home / STEP.format(step) / "manifest.json").read_text())
        drive = _drive_of(tmp_path, step)
        assert manifest["drive"] == drive and manifest["drives"] == [str(tmp_path / "d0" / "ckpts"),
                                                                     str(tmp_path / "d1" / "ckpts")]
        plain = torch.load(tmp_path / f"d{drive}" / "ckpts" / STEP.format(step) / "state.pt", weights_only=True)
        assert all(torch.equal(plain["model"][k], state[k]) for k in state)
    assert not (tmp_path / "d1" / "ckpts" / ".deepnvme-writer.lock").exists()  # the step tree is drive 0's
    with deepnvme.CheckpointManager(vol / "ckpts") as mgr:
        assert mgr.steps() == [1, 2, 3, 4] and mgr.latest_step() == 4
        for step, state in states.items():
            target = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
            assert mgr.restore(target, step=step) == step
            assert all(torch.equal(target["model"][k], state[k]) for k in state)
        assert torch.equal(mgr.load(3)["model"]["w"], states[3]["w"])
    assert main(["verify", str(home)]) == 0  # each step's file found on its drive through its manifest
    (tmp_path / "d1" / "ckpts" / STEP.format(4) / "state.pt").write_bytes(b"short")
    assert main(["verify", str(home)]) == 1


def test_bytes_balance_over_the_kept_steps(tmp_path):
    vol = Volume([tmp_path / "d0", tmp_path / "d1"])
    with deepnvme.CheckpointManager(vol / "ckpts", keep=None, rng=False) as mgr:
        mgr.save(1, {"x": torch.zeros(100_000)})   # d0: big
        mgr.save(2, {"x": torch.zeros(10_000)})    # d1
        mgr.save(3, {"x": torch.zeros(10_000)})    # d1 still holds fewer bytes
        mgr.save(4, {"x": torch.zeros(10_000)})
        mgr.wait()
    assert [_drive_of(tmp_path, s) for s in (1, 2, 3, 4)] == [0, 1, 1, 1]


def test_retention_removes_the_files_on_both_drives(tmp_path):
    _saved(tmp_path, [1, 2, 3, 4, 5], keep=2)
    for d in (0, 1):
        names = sorted(n for n in os.listdir(tmp_path / f"d{d}" / "ckpts") if n.startswith(("step-", ".step-")))
        assert names == [STEP.format(s) for s in (4, 5) if d == 0 or _drive_of(tmp_path, s) == d]
    assert {_drive_of(tmp_path, 4), _drive_of(tmp_path, 5)} == {0, 1}


def test_leftovers_on_every_drive_are_removed(tmp_path, caplog):
    vol, _ = _saved(tmp_path, [1, 2])
    hidden = tmp_path / "d1" / "ckpts" / ".step-000000000003.deepnvme-building-12345-abcd"
    hidden.mkdir()
    (hidden / "state.pt").write_bytes(b"x")
    orphan = tmp_path / "d1" / "ckpts" / STEP.format(3)  # a crash after drive 1's rename, before drive 0's
    orphan.mkdir()
    (orphan / "state.pt").write_bytes(b"y")
    with caplog.at_level("WARNING"), deepnvme.CheckpointManager(vol / "ckpts") as mgr:
        assert mgr.steps() == [1, 2]
    assert not hidden.exists() and not orphan.exists()
    assert str(hidden) in caplog.text and str(orphan) in caplog.text
    assert (tmp_path / "d1" / "ckpts" / STEP.format(2) / "state.pt").is_file()


def test_a_file_lost_on_drive_1_is_a_clear_error_and_other_steps_restore(tmp_path):
    vol, states = _saved(tmp_path, [1, 2, 3])
    assert _drive_of(tmp_path, 2) == 1
    lost = tmp_path / "d1" / "ckpts" / STEP.format(2) / "state.pt"
    lost.unlink()
    with deepnvme.CheckpointManager(vol / "ckpts") as mgr:
        target = {"model": {k: torch.zeros_like(v) for k, v in states[2].items()}}
        with pytest.raises(CheckpointCorruptError, match=r"step 2 is incomplete: .*d1/ckpts/step-000000000002"
                                                         r"/state\.pt' is missing \(volume drive 1"):
            mgr.restore(target, step=2)
        assert mgr.restore(target) == 3   # the newest step is intact
        assert all(torch.equal(target["model"][k], states[3][k]) for k in states[3])


def test_a_drive_not_mounted_or_another_layout_is_refused(tmp_path):
    _saved(tmp_path, [1, 2])
    swapped = Volume([tmp_path / "d1", tmp_path / "d0"])
    with pytest.raises(VolumeLayoutError, match="another order"):
        deepnvme.CheckpointManager(swapped / "ckpts")
    with pytest.raises(VolumeLayoutError, match="stripe=65536"):
        deepnvme.CheckpointManager(Volume([tmp_path / "d0", tmp_path / "d1"], stripe="64K") / "ckpts")
    with pytest.raises(VolumeLayoutError, match=r"volume drive 1 .*d9\) has no record"):
        deepnvme.CheckpointManager(Volume([tmp_path / "d0", tmp_path / "d9"]) / "ckpts")
    shutil.copytree(tmp_path / "d1", tmp_path / "d1-copy")
    with pytest.raises(VolumeLayoutError, match="written on drives"):
        deepnvme.CheckpointManager(Volume([tmp_path / "d0", tmp_path / "d1-copy"]) / "ckpts")
    os.rename(tmp_path / "d1", tmp_path / "d1-away")
    with pytest.raises(VolumeLayoutError, match=r"volume drive 1 .*d1\) .*not mounted"):
        deepnvme.CheckpointManager(Volume([tmp_path / "d0", tmp_path / "d1"]) / "ckpts")


def test_a_whole_volume_as_directory_and_refused_options(tmp_path):
    vol = Volume([tmp_path / "d0", tmp_path / "d1"])
    with deepnvme.CheckpointManager(vol, rng=False) as mgr:
        mgr.save(1, {"x": torch.arange(10)})
        mgr.save(2, {"x": torch.arange(20)})
        mgr.wait()
        assert mgr.steps() == [1, 2]
    assert (tmp_path / "d1" / STEP.format(2) / "state.pt").is_file()
    with pytest.raises(ValueError, match=r"replicas=2\) keeps copies on other nodes.*two nodes"):
        deepnvme.CheckpointManager(vol, replicas=2)  # one process: one node
    with pytest.raises(TypeError, match="or a Volume"):
        deepnvme.CheckpointManager(3)  # type: ignore[arg-type]


def test_a_failed_save_on_drive_1_leaves_nothing_and_keeps_earlier_steps(tmp_path):
    vol = Volume([tmp_path / "d0", tmp_path / "d1"])
    disk = _FullDisk()
    with injected(disk):
        mgr = deepnvme.CheckpointManager(vol / "ckpts", keep=1, rng=False)
        mgr.save(1, {"w": torch.ones(1 << 18)})
        mgr.wait()
        disk.full = True
        mgr.save(2, {"w": torch.zeros(1 << 18)})   # drive 1's turn
        with pytest.raises(OSError) as info:
            mgr.wait()
        assert info.value.errno == errno.ENOSPC and "earlier checkpoints are intact" in str(info.value)
        assert mgr.steps() == [1] and torch.equal(mgr.load()["w"], torch.ones(1 << 18))
        for d in (0, 1):
            assert not [n for n in os.listdir(tmp_path / f"d{d}" / "ckpts") if "step-" in n and n != STEP.format(1)]
        disk.full = False
        mgr.save(2, {"w": torch.zeros(1 << 18)})   # saved again, on drive 1; step 1 retired
        mgr.close()
    assert mgr.steps() == [2] and _drive_of(tmp_path, 2) == 1
    assert not (tmp_path / "d0" / "ckpts" / STEP.format(1)).exists()


def test_durable_copies_are_plain_step_directories_and_restore_on_new_drives(tmp_path):
    vol = Volume([tmp_path / "d0", tmp_path / "d1"])
    lasting = tmp_path / "lasting"
    with deepnvme.CheckpointManager(vol / "ckpts", keep=1, durable=lasting, rng=False) as mgr:
        mgr.save(1, {"w": torch.ones(1000)})
        mgr.save(2, {"w": torch.full((1000,), 2.0)})   # on drive 1
    assert _drive_of(tmp_path, 2) == 1
    copied = lasting / STEP.format(2)
    assert sorted(os.listdir(copied)) == ["manifest.json", "state.pt"]
    assert "drive" not in json.loads((copied / "manifest.json").read_text())
    assert torch.equal(torch.load(copied / "state.pt", weights_only=True)["w"], torch.full((1000,), 2.0))
    for d in (0, 1):  # the pins (hidden folders on each drive) are gone
        assert not [n for n in os.listdir(tmp_path / f"d{d}" / "ckpts") if n.startswith(".step-")]
    fresh = Volume([tmp_path / "e0", tmp_path / "e1"])   # the drives were replaced
    state = {"w": torch.zeros(1000)}
    with deepnvme.CheckpointManager(fresh / "ckpts", durable=lasting) as mgr:
        assert mgr.restore(state) == 2
    assert torch.equal(state["w"], torch.full((1000,), 2.0))
