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


def test_a_staged_share_hands_dcp_tensors_it_does_not_clone():
    """Each staged tensor's storage is exactly its bytes of the arena: DCP's writer clones any
    tensor whose storage is larger (an arena view), a second copy of the whole share."""
    from torch.distributed.checkpoint.filesystem import _SerialCpuLoader

    from deepnvme.checkpoint._arena import ArenaPool
    from deepnvme.checkpoint.manager._dcp_step import stage

    torch.manual_seed(0)
    state = {"w": torch.randn(100, 7), "i": torch.arange(10), "s": torch.tensor(3.0), "b": torch.ones(5).bool(),
             "t": torch.randn(6, 4).t(), "e": torch.empty(0), "meta": {"epoch": 3}}
    planner, plan = local_plan(state, 0)
    pool = ArenaPool(1)
    staged, lease = stage(planner, plan, pool)
    try:
        tensors = {index: t for index, t in staged.items() if isinstance(t, torch.Tensor) and t.numel()}
        assert {index.fqn for index in tensors} == {"w", "i", "s", "b", "t"}
        loader = _SerialCpuLoader(tensors.__getitem__)
        for index in tensors:
            loader.add(0, index)
        for handed, index in loader.values():
            assert handed.data_ptr() == tensors[index].data_ptr()  # the staged bytes, not a clone
            assert handed.untyped_storage().nbytes() == handed.nbytes
            assert torch.equal(handed, state[index.fqn])
    finally:
        lease.release()
        pool.close()
