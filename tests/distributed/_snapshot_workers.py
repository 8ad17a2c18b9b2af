"""What each rank runs in tests/distributed/test_manager_core.py for held snapshots (spawned, so
module-level): after the first save, a snapshot's share is copied in save() without DCP's walk
while the state's tensors stay in place, and walked there when they moved."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import deepnvme
from deepnvme.checkpoint.manager import _snapshot_share
from deepnvme.errors import DistributedSaveError

from ._workers import model_and_optim, same, snapshot, train


def _check(mgr: deepnvme.CheckpointManager, state: dict[str, Any], step: int, expected: dict[str, Any]) -> None:
    model, opt = state["model"], state["optim"]
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert mgr.restore(state, step=step) == step
    got = snapshot(model, opt)
    assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"]), step
    assert torch.equal(state["counter"], torch.full((3,), float(step))), (step, state["counter"])


def moved(rank: int, world: int, directory: str) -> None:
    """Values at save() are saved whether the share was copied without the walk (tensors in place)
    or with it (a parameter's storage replaced); a top-level tensor replaced every step stays on
    the fast path; a walk failing in save() on one rank fails that save on every rank at wait(),
    and the next saves work."""
    model, opt = model_and_optim(ddp=True)
    state: dict[str, Any] = {"model": model, "optim": opt, "counter": torch.zeros(3), "meta": {"k": 1}}
    mgr = deepnvme.CheckpointManager(directory, keep=None, timeout=60)
    ranks = mgr._ranks
    assert ranks is not None
    snaps, saved = ranks.snapshots, {}

    def save(step: int) -> None:
        state["counter"] = torch.full((3,), float(step))  # a new tensor each step
        saved[step] = snapshot(model, opt)
        assert mgr.save(step, state)
        with torch.no_grad():  # after save() returns: not in the step
            state["counter"].add_(100.0)
            for p in model.parameters():
                p.mul_(3.0)

    for step in (1, 2, 3):
        train(model, opt)
        save(step)
        mgr.wait()
    assert (snaps.walked, snaps.fast) == (1, 1)

    first = model.module[0].weight
    with torch.no_grad():
        first.data = first.data.clone() * 2  # the same parameter, new storage: walked in save()
    save(4)
    mgr.wait()
    assert (snaps.walked, snaps.fast) == (2, 1)
    train(model, opt)
    save(5)  # found on save(4)'s writer thread: fast again
    mgr.wait()
    assert (snaps.walked, snaps.fast) == (2, 2)

    real = _snapshot_share.walk_modules

    def failing(*args: Any) -> Any:
        if rank == 1:
            raise ValueError("walk failed on rank 1 (injected)")
        return real(*args)

    with torch.no_grad():
        first.data = first.data.clone()  # moved again: the next save walks in save()
    _snapshot_share.walk_modules = failing
    try:
        save(6)
        with pytest.raises(DistributedSaveError, match="walk failed on rank 1"):
            mgr.wait()
    finally:
        _snapshot_share.walk_modules = real
    save(7)  # the arena was given back: the next save works
    mgr.wait()
    assert mgr.steps() == [1, 2, 3, 4, 5, 7]
    for step in (2, 3, 4, 5, 7):
        _check(mgr, state, step, saved[step])
    mgr.close()
    assert not [n for n in os.listdir(directory) if "building" in n], os.listdir(directory)
