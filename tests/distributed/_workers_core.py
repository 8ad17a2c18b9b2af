"""What each rank runs in tests/distributed/test_manager_core.py (spawned, so module-level)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

import deepnvme
from deepnvme.checkpoint.dcp import NVMeStorageReader, _storage

from ._workers import model_and_optim, same, snapshot, train


def steady(rank: int, world: int, directory: str) -> None:
    """A steady-state save runs no planning exchange (only the step vote); a change of structure
    plans again; a restore reads each replicated item on one rank and broadcasts it, bitwise."""
    model, opt = model_and_optim(ddp=True)
    state: dict[str, Any] = {"model": model, "optim": opt, "meta": {"epoch": 1}}
    mgr = deepnvme.CheckpointManager(directory, keep=3, timeout=30)
    ranks = mgr._ranks
    assert ranks is not None
    said: list[tuple[str, str]] = []
    real = ranks.group.gather

    def counting(obj: Any, *, thread: str, what: str) -> list[Any]:
        said.append((thread, what))
        return real(obj, thread=thread, what=what)

    ranks.group.gather = counting  # type: ignore[method-assign]
    assert mgr.save(1, state)
    mgr.wait()
    assert ranks.planned == 1 and [w for t, w in said if t == "main"] == ["save(1)", "save(1) planning"], said
    said.clear()
    train(model, opt)
    state["meta"] = {"epoch": 2}  # plain data changes value, not structure: the plan holds
    assert mgr.save(2, state)
    mgr.wait()
    assert ranks.planned == 1 and [w for t, w in said if t == "main"] == ["save(2)"], said
    expected = snapshot(model, opt)
    state["extra"] = torch.full((5,), float(rank == 0))  # a new entry: planned again
    assert mgr.save(3, state)
    mgr.wait()
    assert ranks.planned == 2
    del state["extra"]

    read: list[int] = []
    asked: list[int] = []
    real_read, real_share = NVMeStorageReader._read_plan, _storage.share_read

    def counted(self: NVMeStorageReader, plan: Any, planner: Any) -> None:
        read.append(len(plan.items))
        real_read(self, plan, planner)

    def sharing(plan: Any, *args: Any, **kwargs: Any) -> None:
        asked.append(len(plan.items))
        real_share(plan, *args, **kwargs)

    NVMeStorageReader._read_plan = counted  # type: ignore[method-assign]
    _storage.share_read = sharing
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert mgr.restore(state, step=2) == 2
    NVMeStorageReader._read_plan = real_read  # type: ignore[method-assign]
    _storage.share_read = real_share
    got = snapshot(model, opt)
    assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])
    assert state["meta"] == {"epoch": 2}
    counts: list[Any] = [None] * world
    dist.all_gather_object(counts, read[0])
    assert asked[0] == sum(counts) and max(counts) < 0.7 * asked[0], (counts, asked)  # each item read once
    mgr.close()
    assert [n for n in sorted(os.listdir(directory)) if n.startswith("step-")] == [
        f"step-{s:012d}" for s in (1, 2, 3)]
