"""The multi-rank manager's pure parts: who writes what (DCP's planning), and the error every rank raises."""

from __future__ import annotations

import errno

import pytest
import torch
from torch.distributed.checkpoint.planner import WriteItemType

import deepnvme
from deepnvme.checkpoint.manager._dcp_step import global_plans, local_plan
from deepnvme.checkpoint.manager._ranks import _failed


def _replicas(world: int) -> list[tuple[object, object]]:
    torch.manual_seed(0)
    state = {"model": {f"layer{i}.weight": torch.randn(64, 64) for i in range(8)},
             "meta": {"epoch": 3, "tag": "run"}}
    return [local_plan(state, rank) for rank in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_replicated_tensors_are_written_once_split_across_ranks_and_plain_data_by_rank_0(world):
    planned = _replicas(world)
    final, metadata = global_plans(planned[0][0], [plan for _, plan in planned])
    owners: dict[str, list[int]] = {}
    for rank, plan in enumerate(final):
        assert plan.storage_data.prefix == f"__{rank}_"
        for item in plan.items:
            owners.setdefault(item.index.fqn, []).append(rank)
    assert all(len(ranks) == 1 for ranks in owners.values())  # each item written once
    assert set(owners) == set(metadata.state_dict_metadata)
    tensor_bytes = [sum(it.tensor_storage_size() or 0 for it in plan.items
                        if it.type != WriteItemType.BYTE_IO) for plan in final]
    assert max(tensor_bytes) == min(tensor_bytes) == 8 * 64 * 64 * 4 // world
    plain = [fqn for fqn in owners if fqn.startswith("meta.")]
    assert plain and all(owners[fqn] == [0] for fqn in plain)


def test_a_failure_names_the_rank_and_keeps_the_errno():
    own = OSError(errno.ENOSPC, "No space left on device")
    err = _failed("checkpoint step 3", [None, ("OSError", "No space left on device", errno.ENOSPC)], own)
    assert isinstance(err, deepnvme.DeepNVMeIOError) and err.errno == errno.ENOSPC
    assert "rank 1" in str(err) and "rank 0" not in str(err) and err.__cause__ is own
    other = _failed("checkpoint step 3", [("ValueError", "bad state", None), None], None)
    assert isinstance(other, deepnvme.DistributedSaveError) and "rank 0: ValueError: bad state" in str(other)
