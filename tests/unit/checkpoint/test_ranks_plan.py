"""The multi-rank manager's pure parts: who writes what (DCP's planning), and the error every rank raises."""

from __future__ import annotations

import errno

import pytest
import torch
from torch.distributed.checkpoint.planner import WriteItemType

import deepnvme
from deepnvme.checkpoint.dcp._volume import PlacedPrefix
from deepnvme.checkpoint.manager._dcp_step import (
    begin_state_dicts,
    global_plans,
    local_plan,
    placed_plans,
    state_dicts,
    walk_modules,
    walks_later,
)
from deepnvme.checkpoint.manager._node_folders import NodeFolders
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


def _trained() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "sched": sched, "meta": {"epoch": 1, "seen": [1]},
            "ema": torch.ones(4)}


def test_a_held_save_keeps_what_the_loop_may_change_before_the_walk():
    state = _trained()
    begun = begin_state_dicts(state, copy_plain=True)
    walked_now = state_dicts(state)
    # what the loop does after save() and before the writer thread walks the modules
    state["meta"]["seen"].append(2)  # type: ignore[index]
    state["sched"].step()  # type: ignore[attr-defined]  (halves the learning rate)
    state["ema"].add_(1)  # type: ignore[attr-defined]  (a tensor: shared, fenced at the optimizer step)
    later = walk_modules(state, begun)
    assert later["meta"] == {"epoch": 1, "seen": [1]}
    assert later["sched"] == walked_now["sched"] and later["sched"]["_last_lr"] == [0.01]
    assert [g["lr"] for g in later["optim"]["param_groups"]] == [0.01]
    assert state["optim"].param_groups[0]["lr"] == 0.005  # type: ignore[attr-defined]
    assert later["ema"] is not walked_now["ema"] and torch.equal(later["ema"], torch.full((4,), 2.0))
    assert later["model"].keys() == walked_now["model"].keys()
    assert all(torch.equal(later["model"][k], v) for k, v in walked_now["model"].items())
    assert later["optim"]["state"].keys() == walked_now["optim"]["state"].keys()


def test_a_held_save_refuses_param_groups_that_changed_before_the_walk():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    opt = torch.optim.SGD([{"params": model[0].parameters()}], lr=0.01)
    state = {"model": model, "optim": opt}
    begun = begin_state_dicts(state, copy_plain=True)
    opt.add_param_group({"params": model[1].parameters(), "lr": 0.1})
    with pytest.raises(ValueError, match="'optim' changed its param groups"):
        walk_modules(state, begun)


def test_fsdp_modules_are_walked_in_save():
    assert walks_later(_trained())
    assert walks_later({"meta": 1})


def test_each_node_places_only_its_own_ranks_files_on_its_drives():
    planned = _replicas(4)
    final, _ = global_plans(planned[0][0], [plan for _, plan in planned])
    out, placed = placed_plans(final, 2, (2, 3))  # the second node of two, two ranks each
    assert placed and {name[:4] for name in placed} == {"__2_", "__3_"}
    assert all(not isinstance(out[r].storage_data, PlacedPrefix) for r in (0, 1))  # another node's
    assert all(isinstance(out[r].storage_data, PlacedPrefix) for r in (2, 3))
    assert set(placed.values()) == {0, 1}  # both of the node's drives hold files
    assert placed_plans(final, 2)[1].keys() > placed.keys()  # one node: every rank's files


def test_replicas_are_placed_on_top_of_the_nodes_own_bytes():
    class Two:  # the drive folders a NodeFolders needs: placement is pure
        folders = ("/d0/ck", "/d1/ck")

    folders = NodeFolders("/d0/ck", Two())  # type: ignore[arg-type]
    assert folders.place({"a": 10, "b": 10, "c": 3, ".metadata": 5, "manifest.json": 1}, used=[15, 0]) == {
        "a": 1, "b": 1, "c": 0, ".metadata": 0, "manifest.json": 0}
    assert NodeFolders("/plain", None).place({"a": 10, "b": 7}) == {"a": 0, "b": 0}
    assert folders.drive_of("/d1/ck/step-000000000001/__0_0.distcp") == 1
    assert folders.drive_of("/d0/ck/.deepnvme-replicas/rank-00001/x") == 0
