"""CheckpointManager(staging="fenced") across gloo ranks: each rank's share written from the live
tensors, the next optimizer step fenced (copy what is not written, or wait), bitwise round trips."""

from __future__ import annotations

import pytest
import torch

import deepnvme
from deepnvme.checkpoint import FencedStager

from . import _fenced_workers, _held_workers
from ._ranks import run_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")


def test_fenced_replicated_state_on_two_ranks(tmp_path):
    pytest.importorskip("xxhash")
    run_ranks(_fenced_workers.replicated, 2, str(tmp_path), str(tmp_path), deadline=240)


def test_fenced_dtensor_shards_on_two_ranks(tmp_path):
    run_ranks(_fenced_workers.sharded, 2, str(tmp_path), str(tmp_path), deadline=180)


@pytest.mark.parametrize("fn", [_fenced_workers.replicated, _fenced_workers.sharded], ids=["replicated", "dtensor"])
def test_fenced_on_four_ranks(tmp_path, fn):
    pytest.importorskip("xxhash")
    run_ranks(fn, 4, str(tmp_path), str(tmp_path), deadline=300)


def test_fenced_walk_held_for_the_writer_thread(tmp_path):
    run_ranks(_held_workers.held, 2, str(tmp_path), str(tmp_path), deadline=180)


def test_fenced_saves_decided_on_each_rank_without_a_vote(tmp_path):
    run_ranks(_held_workers.decided, 2, str(tmp_path), str(tmp_path), deadline=180)


def test_fenced_fsdp2_walks_in_save(tmp_path):
    run_ranks(_held_workers.fsdp, 2, str(tmp_path), str(tmp_path), deadline=120)


def test_fenced_precopy_is_refused_across_ranks(tmp_path):
    run_ranks(_refuse_precopy, 2, str(tmp_path), str(tmp_path), deadline=60)


def _refuse_precopy(rank: int, world: int, root: str) -> None:
    try:
        deepnvme.CheckpointManager(root, staging=FencedStager(precopy=True), timeout=30)
    except ValueError as exc:
        assert "precopy=True" in str(exc) and "single-process" in str(exc), exc
    else:
        raise AssertionError("precopy across ranks was accepted")
