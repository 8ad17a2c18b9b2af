"""A rank's staged share (the manager's snapshot of what DCP writes): tensors DCP's writer takes as they are."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.filesystem import _SerialCpuLoader

from deepnvme.checkpoint._arena import ArenaPool
from deepnvme.checkpoint.manager._dcp_step import local_plan
from deepnvme.checkpoint.manager._staging import stage


def test_a_staged_share_hands_dcp_tensors_it_does_not_clone():
    """Each staged tensor's storage is exactly its bytes of the arena: DCP's writer clones any
    tensor whose storage is larger (an arena view), a second copy of the whole share."""
    torch.manual_seed(0)
    state = {
        "w": torch.randn(100, 7),
        "i": torch.arange(10),
        "s": torch.tensor(3.0),
        "b": torch.ones(5).bool(),
        "t": torch.randn(6, 4).t(),
        "e": torch.empty(0),
        "meta": {"epoch": 3},
    }
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
