"""What each rank runs in tests/distributed/test_manager_volume.py (spawned, so module-level)."""

from __future__ import annotations

import json
import logging
import os

import torch
import torch.distributed as dist

import deepnvme
from deepnvme import CheckpointCorruptError, Volume

from ._workers import model_and_optim, same, snapshot, train

STEP = "step-{:012d}"


def _data_files(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".distcp")) if os.path.isdir(folder) else []


def ddp_on_volume(rank: int, world: int, root: str) -> None:
    """DDP replicas saved to a volume of two drives: each data file whole on one drive, steps
    listed by drive 0, retention on both drives, bitwise restore, a lost file on drive 1."""
    vol = Volume([os.path.join(root, "d0"), os.path.join(root, "d1")])
    folders = [os.path.join(root, "d0", "ck"), os.path.join(root, "d1", "ck")]
    if rank == 0:  # a crash between drive 1's rename and drive 0's: removed at the first save
        os.makedirs(os.path.join(folders[1], STEP.format(9)))
        with open(os.path.join(folders[1], STEP.format(9), "__0_0.distcp"), "wb") as f:
            f.write(b"x")
    dist.barrier()
    model, opt = model_and_optim(ddp=True)
    state = {"model": model, "optim": opt, "meta": {"epoch": 1}}
    expected = {}
    mgr = deepnvme.CheckpointManager(vol / "ck", keep=2, timeout=30)
    for step in (1, 2, 3):
        train(model, opt)
        state["meta"] = {"epoch": step}
        assert mgr.save(step, state)
        expected[step] = snapshot(model, opt)
        mgr.wait()
    assert mgr.steps() == [2, 3]
    for step in (2, 3):
        home = os.path.join(folders[0], STEP.format(step))
        with open(os.path.join(home, "manifest.json")) as f:
            manifest = json.load(f)
        with open(os.path.join(home, "deepnvme-placement.json")) as f:
            placement = json.load(f)
        on = [_data_files(os.path.join(folder, STEP.format(step))) for folder in folders]
        assert len(on[0]) == len(on[1]) == 1, on  # one file per rank, one per drive (balanced by bytes)
        assert placement["files"] == {on[0][0]: 0, on[1][0]: 1}
        assert placement["drives"] == [os.path.join(folder, STEP.format(step)) for folder in folders]
        assert set(manifest["files"]) == {".metadata", "deepnvme-placement.json", *on[0], *on[1]}
        assert os.path.isfile(os.path.join(home, ".metadata"))
    dist.barrier()
    for folder in folders:  # retention removed step 1 on both drives; no leftovers
        assert sorted(n for n in os.listdir(folder) if "step-" in n) == [STEP.format(2), STEP.format(3)]
    if rank == 0:
        torch.save({s: expected[s] for s in (2, 3)}, os.path.join(root, "expected.pt"))

    # restore bitwise into the live model and optimizer, from either step
    for step in (2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        assert mgr.restore(state, step=step) == step
        got = snapshot(model, opt)
        assert same(got["model"], expected[step]["model"]) and same(got["optim"], expected[step]["optim"])
        assert state["meta"] == {"epoch": step}

    # step 3's data file on drive 1 is lost: step 3 fails on every rank, naming the path; the
    # newest-step restore skips it and reads step 2
    dist.barrier()
    lost = os.path.join(folders[1], STEP.format(3), _data_files(os.path.join(folders[1], STEP.format(3)))[0])
    dist.barrier()
    if rank == 0:
        os.unlink(lost)
    dist.barrier()
    try:
        mgr.restore(state, step=3)
    except CheckpointCorruptError as exc:
        assert lost in str(exc) and "missing" in str(exc), exc
    else:
        raise AssertionError("a step missing a file on drive 1 was restored")
    logging.getLogger("deepnvme").setLevel(logging.ERROR)  # the skipped step is logged as a warning
    assert mgr.restore(state) == 2
    assert same(snapshot(model, opt)["model"], expected[2]["model"])
    mgr.close()


def fenced_checksummed(rank: int, world: int, root: str) -> None:
    """Fenced saves with per-file checksums on a volume: checksums of files on both drives are
    checked at restore; a flipped byte in drive 1's file fails that step on every rank."""
    vol = Volume([os.path.join(root, "d0"), os.path.join(root, "d1")])
    torch.manual_seed(5)
    state = {"a": torch.randn(300, 300), "b": torch.randn(200, 200), "c": torch.randn(100)}
    with deepnvme.CheckpointManager(vol, staging="fenced", checksums="crc32c", keep=None, timeout=30) as mgr:
        assert mgr.save(1, state)
        mgr.wait()
        want = {k: v.clone() for k, v in state.items()}
        with torch.no_grad():
            for v in state.values():
                v.zero_()
        assert mgr.restore(state) == 1
        assert all(torch.equal(state[k], want[k]) for k in want)
        assert mgr.save(2, state)
        mgr.wait()
        dist.barrier()
        folder = os.path.join(root, "d1", STEP.format(2))
        if rank == 0:
            name = _data_files(folder)[0]
            with open(os.path.join(folder, name), "r+b") as f:
                f.seek(100)
                byte = f.read(1)
                f.seek(100)
                f.write(bytes([byte[0] ^ 0xFF]))
        dist.barrier()
        try:
            mgr.restore(state, step=2)
        except CheckpointCorruptError as exc:
            assert "checksum" in str(exc) or "corrupt" in str(exc), exc
        else:
            raise AssertionError("a flipped byte on drive 1 was not noticed")
        logging.getLogger("deepnvme").setLevel(logging.ERROR)
        assert mgr.restore(state) == 1
        assert all(torch.equal(state[k], want[k]) for k in want)


def durable_on_volume(rank: int, world: int, root: str) -> None:
    """durable= over two ranks on a volume: each rank copies its data files from the drive they lie
    on into one plain DCP folder (no placement record); a restore reads the volume's own copy
    while it is whole, the durable copy once the drives are new."""
    vol = Volume([os.path.join(root, "d0"), os.path.join(root, "d1")])
    lasting = os.path.join(root, "lasting")
    model, opt = model_and_optim(ddp=True)
    state = {"model": model, "optim": opt}
    expected = {}
    with deepnvme.CheckpointManager(vol / "ck", keep=1, durable=lasting, timeout=30) as mgr:
        for step in (1, 2):
            train(model, opt)
            assert mgr.save(step, state)
            mgr.wait()
            expected[step] = snapshot(model, opt)
    dist.barrier()
    for folder in (os.path.join(root, "d0", "ck", STEP.format(2)), os.path.join(root, "d1", "ck", STEP.format(2))):
        assert len(_data_files(folder)) == 1, folder  # the step lies on both drives
    copy = os.path.join(lasting, STEP.format(2))
    assert sorted(os.listdir(copy)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
    with open(os.path.join(copy, "manifest.json")) as f:
        manifest = json.load(f)
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "__1_0.distcp"], manifest["files"]
    assert "drives" not in manifest and "drive" not in manifest
    if rank == 0:
        torch.save(expected[2], os.path.join(root, "expected.pt"))
    dist.barrier()

    def zeroed() -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()

    # the volume whole, an empty durable tier: restored from the drives (the tiers see both)
    zeroed()
    with deepnvme.CheckpointManager(vol / "ck", durable=os.path.join(root, "empty"), timeout=30) as mgr:
        assert mgr.steps() == [2] and mgr.restore(state) == 2
    assert same(snapshot(model, opt)["model"], expected[2]["model"])
    # new drives: restored from the durable copy, a plain folder
    fresh = Volume([os.path.join(root, "n0"), os.path.join(root, "n1")])
    zeroed()
    with deepnvme.CheckpointManager(fresh / "ck", durable=lasting, timeout=30) as mgr:
        assert mgr.restore(state) == 2
    got = snapshot(model, opt)
    assert same(got["model"], expected[2]["model"]) and same(got["optim"], expected[2]["optim"])
