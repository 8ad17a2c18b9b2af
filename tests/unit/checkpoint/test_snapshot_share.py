"""Held snapshots' pure parts: the state's tensors listed without DCP's walk, their signature, and
where each item of a rank's share is among them."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.planner import WriteItemType

from deepnvme.checkpoint.manager._dcp_step import begin_state_dicts, local_plan, walk_modules
from deepnvme.checkpoint.manager._snapshot_share import _sources, list_tensors


def _trained() -> dict[str, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    return {"model": model, "optim": opt, "meta": {"epoch": 1}, "ema": torch.ones(4)}


def _listing(state: dict[str, Any]) -> Any:
    return list_tensors(state, begin_state_dicts(state, copy_plain=True))


def test_the_listing_holds_every_tensor_the_walk_saves_and_its_signature_is_stable():
    state = _trained()
    begun = begin_state_dicts(state, copy_plain=True)
    listing = list_tensors(state, begun)
    saved = walk_modules(state, begun)
    walked = [*saved["model"].values(), *(v for s in saved["optim"]["state"].values() for v in s.values()),
              saved["ema"]]
    places = {(t.data_ptr(), t.shape) for t in listing.tensors}
    assert all((t.data_ptr(), t.shape) in places for t in walked)
    state["meta"]["epoch"] = 2  # values change, places stay: the same signature
    state["ema"] = torch.zeros(4)  # a top-level tensor replaced: taken at save(), compared by place only
    with torch.no_grad():
        state["model"][0].weight.add_(1)
    assert _listing(state).signature == listing.signature


def test_the_signature_changes_when_a_tensor_moves_or_the_structure_changes():
    state = _trained()
    first = _listing(state).signature
    with torch.no_grad():
        state["model"][0].weight.data = state["model"][0].weight.data.clone()
    moved = _listing(state).signature
    assert moved != first
    state["meta"]["new"] = 1
    assert _listing(state).signature != moved
    del state["meta"]["new"]
    state["optim"].param_groups[0]["extra"] = 0.5
    assert _listing(state).signature != moved


def test_state_only_the_walk_reads_has_no_signature():
    class Extra(torch.nn.Linear):
        def get_extra_state(self) -> Any:
            return {"calls": 1}

        def set_extra_state(self, state: Any) -> None:
            pass

    state = _trained()
    state["model"].append(Extra(2, 2))
    assert _listing(state).signature is None
    state = _trained()
    opt = state["optim"]
    opt.state[next(iter(opt.state))]["count"] = 3  # a non-tensor optimizer state value
    assert _listing(state).signature is None


def test_each_tensor_item_of_a_share_is_found_in_the_listing():
    state = _trained()
    begun = begin_state_dicts(state, copy_plain=True)
    listing = list_tensors(state, begun)
    planner, plan = local_plan(walk_modules(state, begun), 0)
    found = _sources(listing, planner, plan, cache=None)  # type: ignore[arg-type]
    assert found is not None
    tensors = [i for i in plan.items if i.type != WriteItemType.BYTE_IO]
    assert [index for index, _ in found.items] == [i.index for i in tensors]
    for index, at in found.items:
        item = next(i for i in tensors if i.index == index)
        assert torch.equal(listing.tensors[at], planner.resolve_data(item))
