"""CheckpointManager across gloo ranks on a Volume: DCP data files placed on the drives, the step
committed on every drive, retention, bitwise restore, a lost file, and stock dcp.load after
gather_folder."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import deepnvme
from deepnvme import Volume

from . import _volume_tier_workers, _volume_workers
from ._ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")


def test_ddp_state_on_a_volume_of_two_drives(tmp_path):
    root = str(tmp_path)
    run_ranks(_volume_workers.ddp_on_volume, 2, root, root, deadline=120)
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)[2]
    vol = Volume([tmp_path / "d0", tmp_path / "d1"])
    plain = tmp_path / "plain"
    copied = deepnvme.gather_folder(vol / "ck" / "step-000000000002", plain)
    assert ".metadata" in copied and sum(n.endswith(".distcp") for n in copied) == 2
    target = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    dcp.load(target, checkpoint_id=str(plain))  # stock reader, one process
    assert all(torch.equal(target["model"][k], expected["model"][k]) for k in expected["model"])
    # one process restores the multi-rank step from the volume (resharded into one)
    model = torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(6)])
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters(), lr=0.01), "meta": {}}
    with deepnvme.CheckpointManager(vol / "ck", rng=False) as mgr:
        assert mgr.restore(state, step=2) == 2
    assert all(torch.equal(model.state_dict()[k], expected["model"][k]) for k in expected["model"])
    assert not os.path.exists(tmp_path / "d1" / "ck" / "step-000000000009")  # the crash leftover


def test_fenced_saves_with_checksums_on_a_whole_volume(tmp_path):
    pytest.importorskip("crc32c")
    run_ranks(_volume_workers.fenced_checksummed, 2, str(tmp_path), str(tmp_path), deadline=120)
    assert _volume_workers._data_files(str(tmp_path / "d0" / "step-000000000001"))
    assert _volume_workers._data_files(str(tmp_path / "d1" / "step-000000000001"))


def test_durable_copy_of_a_volume_step_is_a_plain_dcp_folder(tmp_path):
    run_ranks(_volume_workers.durable_on_volume, 2, str(tmp_path), str(tmp_path), deadline=120)
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    target = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    dcp.load(target, checkpoint_id=str(tmp_path / "lasting" / "step-000000000002"))  # stock reader
    assert all(torch.equal(target["model"][k], expected["model"][k]) for k in expected["model"])


def test_replicas_on_two_nodes_each_with_a_volume(tmp_path):
    root = str(tmp_path)
    run_ranks(_volume_tier_workers.replicas_on_volumes, 2, root, root, 1, deadline=150)
    # stock dcp.load reads a step once each node's drives are gathered into one folder (here the
    # healed node 1 alone holds step 3: its own files and node 0's replica, rebuilt on restore)
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    plain = tmp_path / "plain"
    vol = Volume(_volume_tier_workers.drives_of(root, 1))
    copied = deepnvme.gather_folder(vol / "ck" / "step-000000000003", plain)
    replica = vol / "ck" / ".deepnvme-replicas" / "rank-00000" / "step-000000000003"
    copied += deepnvme.gather_folder(replica, plain)
    assert sum(n.endswith(".distcp") for n in set(copied)) == 2
    target = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    dcp.load(target, checkpoint_id=str(plain))
    assert all(torch.equal(target["model"][k], expected["model"][k]) for k in expected["model"])
    # the durable copy, drained from both nodes' drives, is a plain DCP folder
    assert sorted(os.listdir(tmp_path / "durable" / "step-000000000003")) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "manifest.json"]
    target = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    dcp.load(target, checkpoint_id=str(tmp_path / "durable" / "step-000000000003"))
    assert all(torch.equal(target["model"][k], expected["model"][k]) for k in expected["model"])


@pytest.mark.slow
def test_replicas_on_two_nodes_of_two_ranks_each_with_a_volume(tmp_path):
    root = str(tmp_path)
    run_ranks(_volume_tier_workers.replicas_on_volumes, 4, root, root, 2, deadline=280)


def test_a_failed_publish_on_one_node_takes_the_step_back_on_every_drive(tmp_path):
    run_ranks(_volume_tier_workers.failed_commit_on_volumes, 2, str(tmp_path), str(tmp_path), deadline=120)
