"""CheckpointManager across gloo ranks: cached save plans, shared restore reads, checksums while
writing, DTensor meshes, resharding W=4 -> 2 -> 1, and a job killed at each phase of a save."""

from __future__ import annotations

import logging
import os

import pytest
import torch

import deepnvme
from deepnvme.checkpoint.manager._ranks import PHASES

from . import _snapshot_workers, _workers_core
from ._ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")


def test_steady_saves_reuse_the_plan_and_restore_reads_each_item_once(tmp_path):
    run_ranks(_workers_core.steady, 2, str(tmp_path), str(tmp_path / "ck"), deadline=240)


def test_held_snapshots_copy_the_share_without_the_walk_while_tensors_stay_in_place(tmp_path):
    run_ranks(_snapshot_workers.moved, 2, str(tmp_path), str(tmp_path / "ck"), deadline=240)


@pytest.mark.parametrize("where", ["data", "header"])
def test_a_flipped_byte_in_one_ranks_file_fails_that_step_on_every_rank(tmp_path, where):
    pytest.importorskip("crc32c")
    run_ranks(_workers_core.flipped, 2, str(tmp_path), str(tmp_path / "ck"), where, deadline=240)


@pytest.mark.slow
def test_dtensor_meshes_on_4_ranks_restore_into_2_ranks_1_process_and_stock_dcp(tmp_path, caplog):
    pytest.importorskip("crc32c")
    directory, out = str(tmp_path / "ck"), str(tmp_path / "full.pt")
    run_ranks(_workers_core.meshes, 4, str(tmp_path), directory, out, deadline=240)
    run_ranks(_workers_core.resharded, 2, str(tmp_path), directory, out, deadline=240)
    full = torch.load(out, weights_only=True)
    state = {"a": torch.zeros(16, 8), "b": torch.zeros(12, 6), "c": torch.zeros(10), "r": torch.zeros(6),
             "info": {"k": 0}}
    with caplog.at_level(logging.WARNING), deepnvme.CheckpointManager(directory, checksums="crc32c") as mgr:
        assert mgr.restore(state) == 1
    assert all(torch.equal(state[k], full[k]) for k in full) and state["info"] == {"k": 1}
    assert "RNG states are left as they are" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("phase", PHASES)
def test_a_job_killed_at_each_phase_restarts_from_a_complete_step(tmp_path, phase):
    pytest.importorskip("crc32c")
    directory = str(tmp_path / "ck")
    with pytest.raises(Exception, match="signal|SIGKILL|exit"):
        run_ranks(_workers_core.killed, 2, str(tmp_path), directory, phase, deadline=240)
    newest = 2 if phase == "retention" else 1  # killed before its publish: the step is not listed
    if phase != "retention":
        assert not os.path.isdir(os.path.join(directory, "step-000000000002"))
    run_ranks(_workers_core.restart, 2, str(tmp_path), directory, newest, deadline=240)
