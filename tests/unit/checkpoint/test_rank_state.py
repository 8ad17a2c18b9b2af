"""Per-rank state of the manager: argument checks, its bytes, the world-size rule, and who writes it."""

from __future__ import annotations

import pytest
import torch

import deepnvme
from deepnvme.checkpoint.manager._dcp_step import global_plans, local_plan, rng_entry
from deepnvme.checkpoint.manager._rank_state import (
    check_restore_arg,
    check_save_arg,
    fill,
    pack,
    refuse_other_world,
    unpack,
)
from deepnvme.checkpoint.manager._steps import RANK_STATE_KEY


def test_arguments_are_checked():
    assert check_save_arg(None) is None
    assert check_save_arg({"a": 1}) == {"a": 1}
    with pytest.raises(ValueError, match="str keys"):
        check_save_arg({1: 2})
    with pytest.raises(ValueError, match="mapping with str keys, got list"):
        check_save_arg([1])
    for ok in (None, "skip", {}):
        check_restore_arg(ok)
    with pytest.raises(ValueError, match="'keep'"):
        check_restore_arg("keep")


def _list_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    torch.save([1, 2], buf)
    return buf.getvalue()


def test_bytes_round_trip_and_fill_updates_in_place():
    data = {"pos": 7, "t": torch.arange(3), "names": ["a", "b"]}
    back = unpack(pack(data))
    assert back["pos"] == 7 and torch.equal(back["t"], torch.arange(3)) and back["names"] == ["a", "b"]
    target = {"pos": 0, "kept": True}
    fill(target, back)
    assert target["pos"] == 7 and target["kept"] is True
    fill("skip", back)  # nothing to fill
    with pytest.raises(deepnvme.CheckpointMismatchError, match="not a mapping"):
        unpack(_list_bytes())


def test_another_world_size_is_an_error_naming_the_keys_unless_skipped():
    assert refuse_other_world(["b", "a"], saved_world=2, world=2, rank_state={}, what="step 3") is True
    assert refuse_other_world(["a"], saved_world=2, world=2, rank_state=None, what="step 3") is False
    assert refuse_other_world(None, saved_world=2, world=4, rank_state={}, what="step 3") is False
    assert refuse_other_world(["a"], saved_world=2, world=4, rank_state="skip", what="step 3") is False
    for given in ({}, None):
        with pytest.raises(deepnvme.CheckpointMismatchError, match=r"step 3 holds .*\['a', 'b'\].*2 rank") as info:
            refuse_other_world(["b", "a"], saved_world=2, world=4, rank_state=given, what="step 3")
        assert info.value.unexpected_keys == ["a", "b"]


def test_each_rank_writes_its_own_rank_state():
    world = 2
    planned = []
    for rank in range(world):
        state = {"w": torch.ones(8), RANK_STATE_KEY: {rng_entry(rank): pack({"pos": rank})}}
        planned.append(local_plan(state, rank))
    final, metadata = global_plans(planned[0][0], [plan for _, plan in planned])
    for rank, plan in enumerate(final):
        mine = [it.index.fqn for it in plan.items if it.index.fqn.startswith(RANK_STATE_KEY)]
        assert mine == [f"{RANK_STATE_KEY}.{rng_entry(rank)}"]
    assert {f"{RANK_STATE_KEY}.rank0", f"{RANK_STATE_KEY}.rank1"} <= set(metadata.state_dict_metadata)
