"""What each rank runs in tests/distributed/test_manager_fenced.py for held saves (spawned, so
module-level): a fenced save whose DCP walk, planning and staging run on the writer thread
while the loop goes on, the next optimizer step waiting until the share is staged."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import deepnvme
from deepnvme.checkpoint.manager import _ranks
from deepnvme.errors import DistributedSaveError

from ._fenced_workers import _at_step, _big_model, _train, _zero
from ._workers import same, snapshot


def _walk_after(event: threading.Event, seen: list[str], *, fail: bool = False) -> Any:
    """``_ranks.walk_modules`` that starts once ``event`` is set, 0.3 s later (the thread it ran
    on appended to ``seen``), raising instead with ``fail``."""
    real = _ranks.walk_modules

    def walk(*args: Any) -> Any:
        assert event.wait(30)
        time.sleep(0.3)
        seen.append(threading.current_thread().name)
        if fail:
            raise ValueError("walk failed (injected)")
        return real(*args)

    return walk


def held(rank: int, world: int, root: str) -> None:
    """DDP replicas, fenced: save() returns before DCP's walk; what the loop changes before its
    optimizer step (plain data, the learning rate) is saved as it was at save(); the step waits
    for the staging; a steady-state save runs no planning exchange, a new entry does; a walk
    that fails on one rank fails the save on every rank at wait(), and the next save works."""
    model, opt = _big_model()
    meta: dict[str, Any] = {"epoch": 1, "seen": [1, 2]}
    state: dict[str, Any] = {"model": model, "optim": opt, "meta": meta}
    at_step, hook = _at_step(opt)
    mgr = deepnvme.CheckpointManager(os.path.join(root, "held"), staging="fenced", keep=None, timeout=60)
    ranks = mgr._ranks
    assert ranks is not None
    assert mgr.save(1, state)
    mgr.wait()
    assert ranks.plans.planned == 1

    real, seen = _ranks.walk_modules, []
    at_step.clear()
    _ranks.walk_modules = _walk_after(at_step, seen)
    assert mgr.save(2, state)  # returns before the walk (which waits for the step)
    expected, lr = snapshot(model, opt), opt.param_groups[0]["lr"]
    meta["epoch"] = 2
    meta["seen"].append(3)
    for group in opt.param_groups:
        group["lr"] = 0.5
    _train(model, opt)  # waits for the held staging (about 0.3 s), then the fence copies
    mgr.wait()
    _ranks.walk_modules = real
    stats = mgr.stats
    assert seen == ["deepnvme-checkpoint-ranks-writer"], seen
    assert stats.fence_wait_seconds > 0.2, stats
    assert ranks.plans.planned == 1  # the structure was the cached plan's
    _zero(model)
    state["meta"] = {"epoch": 0, "seen": [0, 0]}
    assert mgr.restore(state, step=2) == 2
    got = snapshot(model, opt)
    assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])
    assert state["meta"] == {"epoch": 1, "seen": [1, 2]}, state["meta"]
    assert opt.param_groups[0]["lr"] == lr

    # a new entry: the writer thread runs the planning exchange
    state["extra"] = torch.arange(100_000, dtype=torch.float32)
    assert mgr.save(3, state)
    mgr.wait()
    assert ranks.plans.planned == 2

    # the walk fails on rank 1: every rank raises at wait(); the step did not hang
    at_step.clear()
    _ranks.walk_modules = _walk_after(at_step, [], fail=rank == 1)
    assert mgr.save(4, state)
    _train(model, opt)
    try:
        mgr.wait()
    except DistributedSaveError as exc:
        assert "rank 1" in str(exc) and "walk failed (injected)" in str(exc), exc
    else:
        raise AssertionError("a failed walk on rank 1 was not reported")
    _ranks.walk_modules = real
    assert not os.path.exists(os.path.join(root, "held", ".step-000000000004.building"))
    assert mgr.save(5, state)
    mgr.wait()
    assert mgr.steps() == [1, 2, 3, 5] and ranks.plans.planned == 3, (mgr.steps(), ranks.plans.planned)  # not reused
    extra = state["extra"].clone()
    state["extra"].zero_()
    assert mgr.restore(state) == 5 and torch.equal(state["extra"], extra)
    mgr.close()
    hook.remove()


def fsdp(rank: int, world: int, root: str) -> None:
    """FSDP2 modules, fenced: not held (the forward swaps FSDP's parameters in and out of the
    module), so DCP's walk runs in save(); the shards restore bitwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(2)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)

    def step() -> None:
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    state = {"model": model, "optim": opt}
    held_calls: list[int] = []
    real = _ranks.RankSteps._write_held
    _ranks.RankSteps._write_held = (  # type: ignore[method-assign]
        lambda self, step, *a: held_calls.append(step) or real(self, step, *a))
    with deepnvme.CheckpointManager(os.path.join(root, "fsdp"), staging="fenced", timeout=60) as mgr:
        assert mgr.save(1, state)
        saved = {k: v.to_local().clone() for k, v in model.state_dict().items()}
        step()
        mgr.wait()
        assert held_calls == [], held_calls
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().zero_()
        assert mgr.restore(state) == 1
        assert all(torch.equal(v.to_local(), saved[k]) for k, v in model.state_dict().items())
    _ranks.RankSteps._write_held = real  # type: ignore[method-assign]
    dist.barrier()


def _count(group: Any, said: list[tuple[str, str]]) -> None:
    """Note each of ``group``'s gathers in ``said`` as (thread, what)."""
    real = group.gather

    def counting(obj: Any, *, thread: str, what: str) -> list[Any]:
        said.append((thread, what))
        return real(obj, thread=thread, what=what)

    group.gather = counting


def decided(rank: int, world: int, root: str) -> None:
    """Held saves after the first: every rank decides from the step alone, so ``save()`` runs no
    collective on the caller's thread (due or not); a step not greater than the last raises at
    once; a rank that passes another step, or fails alone, fails the save on every rank at
    ``wait()`` and the next save works; with ``every_seconds`` the ranks still vote."""
    model, opt = _big_model()
    state: dict[str, Any] = {"model": model, "optim": opt}
    mgr = deepnvme.CheckpointManager(os.path.join(root, "decided"), staging="fenced", every_steps=2, keep=None,
                                     timeout=30)
    ranks = mgr._ranks
    assert ranks is not None
    said: list[tuple[str, str]] = []
    _count(ranks.group, said)
    assert mgr.save(2, state)
    assert [w for t, w in said if t == "main"] == ["save(2)"], said  # the first save votes
    said.clear()
    assert not mgr.save(3, state)  # not due: decided here
    assert mgr.save(4, state)
    mgr.wait()
    assert [w for t, w in said if t == "main"] == [], said
    assert ("writer", "save(4) structure") in said, said
    try:
        mgr.save(4, state)
    except ValueError as exc:
        assert "not greater than the newest saved step 4" in str(exc), exc
    else:
        raise AssertionError("step 4 was accepted twice")

    # rank 1 passes another step: both are due, the writer threads' exchange fails both
    assert mgr.save(6 if rank == 0 else 8, state)
    try:
        mgr.wait()
    except ValueError as exc:
        assert "passed other steps" in str(exc), exc
    else:
        raise AssertionError("different steps on the ranks were not reported")

    # the leader fails alone to make the step's folder: every rank hears it at wait()
    real_prepare = ranks._prepare
    if rank == 0:
        def failing(building: str) -> None:
            raise OSError(28, "No space left on device (injected)", building)

        ranks._prepare = failing  # type: ignore[method-assign]
    assert mgr.save(10, state)  # not raised here, so every rank counts the save alike
    try:
        mgr.wait()
    except Exception as exc:
        assert "rank 0" in str(exc) and "No space left" in str(exc), exc
    else:
        raise AssertionError("the leader's failure was not reported")
    ranks._prepare = real_prepare  # type: ignore[method-assign]
    _train(model, opt)
    expected = snapshot(model, opt)
    assert mgr.save(12, state)
    mgr.wait()
    assert mgr.steps() == [2, 4, 12], mgr.steps()
    _zero(model)
    assert mgr.restore(state) == 12
    got = snapshot(model, opt)
    assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])

    # a save walked in save() (as for FSDP modules) right after a held one: the held save's writer
    # may have replaced the cached plan meanwhile, so it plans again rather than trust the cache
    real_walks = _ranks.walks_later
    _ranks.walks_later = lambda state: False
    said.clear()
    assert mgr.save(14, state)
    mgr.wait()
    _ranks.walks_later = real_walks
    assert [w for t, w in said if t == "main"] == ["save(14)", "save(14) planning"], said
    mgr.close()

    with deepnvme.CheckpointManager(os.path.join(root, "timed"), staging="fenced", every_seconds=3600,
                                    timeout=30) as timed:
        said.clear()
        assert timed._ranks is not None
        _count(timed._ranks.group, said)
        assert timed.save(1, state) and not timed.save(2, state)
        assert [w for t, w in said if t == "main"] == ["save(1)", "save(2)"], said  # time: rank 0 decides
