"""What each rank runs in tests/distributed/test_manager_fenced.py (spawned, so module-level):
``staging="fenced"`` across ranks, with DDP replicas and DTensor shards large enough to be
written from the live tensors (items of 256 KiB and more)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.nn.parallel import DistributedDataParallel

import deepnvme
from deepnvme.checkpoint import FencedStager
from deepnvme.checkpoint.manager import _fenced_share, _ranks

from ._workers import same, snapshot, sync_replicas


def _big_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """DDP over four 512x512 layers (1 MiB weights, and AdamW moments as large), trained once."""
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(4)]))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    opt.zero_grad()
    sync_replicas(model, opt)  # after the step (and its fence): DDP replicas can differ in the last bits


def _zero(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()


def _at_step(opt: torch.optim.Optimizer) -> tuple[threading.Event, Any]:
    """An event set when ``opt.step()`` begins, before the manager's fence (a hook registered
    before the first save runs first), and the hook's handle."""
    event = threading.Event()
    return event, opt.register_step_pre_hook(lambda *_: event.set())


def differing(got: dict[str, Any], expected: dict[str, Any], after: dict[str, Any], path: str) -> list[str]:
    """The entries of two snapshots that are not bitwise equal, each with what it holds instead
    (the value after the step, zeros, other) and what stock DCP reads of it from ``path``."""
    out = []
    for part in ("model", "optim"):
        for k, want in expected[part].items():
            have = got[part].get(k)
            if have is not None and torch.equal(have, want):
                continue
            what = ("missing" if have is None else "after-step" if torch.equal(have, after[part][k])
                    else "zeros" if not have.any() else f"other (max diff {(have - want).abs().max()})")
            line = f"{part}.{k}: {what}"
            if part == "model":
                stock = {"model": {k: torch.zeros_like(want)}}
                dcp.load(stock, checkpoint_id=path, no_dist=True)
                line += f"; stock DCP reads {'the saved value' if torch.equal(stock['model'][k], want) else 'another'}"
            out.append(line)
    return out


def _writes_after(event: threading.Event, times: dict[str, float]) -> Any:
    """``_ranks.write_share`` that starts once ``event`` is set, 0.3 s later (when it starts:
    ``times["write"]``), so the step finds the whole share waiting."""
    real = _ranks.write_share

    def held(*args: Any, **kwargs: Any) -> Any:
        assert event.wait(30)
        time.sleep(0.3)
        times["write"] = time.perf_counter()
        return real(*args, **kwargs)

    return held


def replicated(rank: int, world: int, root: str) -> None:
    """DDP replicas, fenced: the optimizer step right after ``save()`` copies what is not written
    and goes on (the step keeps the values save() saw, bitwise); with ``staging_bytes=0`` the step
    waits for the write; an item in flight at the step is waited for, the rest copied; checksums
    of the bytes written verify; stock DCP reads the step."""
    model, opt = _big_model()
    at_step, hook = _at_step(opt)
    state: dict[str, Any] = {"model": model, "optim": opt, "meta": {"epoch": 1}}
    real = _ranks.write_share
    directory = os.path.join(root, "fenced")
    mgr = deepnvme.CheckpointManager(directory, staging="fenced", checksums="xxh64", timeout=60)
    assert mgr.mode == "fenced"
    assert mgr.save(1, state)
    mgr.wait()
    assert mgr.stats.fence_copied_bytes == 0  # no step ran while it was written
    times: dict[str, float] = {}
    fenced = opt.register_step_pre_hook(lambda *_: times.update(fenced=time.perf_counter()))  # after the fence

    # 1) the writer is late: the step copies the waiting items and goes on
    at_step.clear()
    _ranks.write_share = _writes_after(at_step, times)
    assert mgr.save(2, state)
    expected = snapshot(model, opt)
    _train(model, opt)  # the fence: copies what save(2) has not written, then the step changes it
    after_step = snapshot(model, opt)
    assert not same(after_step["model"], expected["model"])
    mgr.wait()
    _ranks.write_share = real
    stats = mgr.stats
    _zero(model)
    assert mgr.restore(state, step=2) == 2
    got = snapshot(model, opt)
    path = os.path.join(directory, "step-000000000002")
    assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"]), (
        differing(got, expected, after_step, path), stats, times)
    assert stats.fence_copied_bytes > 0, stats
    assert times["fenced"] < times["write"], times  # the step did not wait for the write
    plain = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    dcp.load(plain, checkpoint_id=path)  # stock DCP
    assert same(plain["model"], expected["model"])
    mgr.close()

    # 2) staging_bytes=0: nothing copied, the step waits until its tensors are written (the
    # write starts only once the step is at its fence, and later still)
    _train(model, opt)
    at_step.clear()
    waiting = deepnvme.CheckpointManager(os.path.join(root, "nocopy"), staging=FencedStager(staging_bytes=0),
                                         timeout=60)
    _ranks.write_share = _writes_after(at_step, times)
    assert waiting.save(3, state)
    fenced.remove()  # again after this manager's fence
    fenced = opt.register_step_pre_hook(lambda *_: times.update(fenced=time.perf_counter()))
    expected = snapshot(model, opt)
    _train(model, opt)
    waiting.wait()
    _ranks.write_share = real
    assert waiting.stats.fence_copied_bytes == 0 and times["fenced"] > times["write"], (waiting.stats, times)
    _zero(model)
    assert waiting.restore(state) == 3
    got = snapshot(model, opt)
    assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])
    waiting.close()

    # 3) an item in flight at the step: the step waits for it; the waiting ones are copied
    real_resolve = _fenced_share.ShareFence.resolve
    first = threading.Event()

    def slow_resolve(self: Any, index: Any) -> Any:
        data = real_resolve(self, index)
        if index in self.items and not first.is_set():  # the first large item, now in flight
            first.set()
            assert at_step.wait(30)  # until the step is at its fence, and later still
            time.sleep(0.3)
        return data

    _fenced_share.ShareFence.resolve = slow_resolve  # type: ignore[method-assign]
    flight = deepnvme.CheckpointManager(os.path.join(root, "flight"), staging="fenced", timeout=60)
    _train(model, opt)
    at_step.clear()
    assert flight.save(4, state)
    expected = snapshot(model, opt)
    assert first.wait(30)
    _train(model, opt)
    flight.wait()
    _fenced_share.ShareFence.resolve = real_resolve  # type: ignore[method-assign]
    assert flight.stats.fence_copied_bytes > 0 and flight.stats.fence_wait_seconds > 0.2, flight.stats
    _zero(model)
    assert flight.restore(state) == 4
    got = snapshot(model, opt)
    assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])
    flight.close()
    hook.remove()
    fenced.remove()


def sharded(rank: int, world: int, root: str) -> None:
    """DTensor parameters (1-D mesh; with 4 ranks also a 2-D mesh) under AdamW, fenced: the step
    right after ``save()`` changes the shards; the step restores the saved shards bitwise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    meshes = [init_device_mesh("cpu", (world,))]
    if world == 4:
        meshes.append(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")))
    for i, mesh in enumerate(meshes):
        torch.manual_seed(0)
        layout = [Shard(0)] if mesh.ndim == 1 else [Replicate(), Shard(1)]
        w = torch.nn.Parameter(distribute_tensor(torch.randn(1024, 512), mesh, layout))
        b = torch.nn.Parameter(distribute_tensor(torch.randn(2048, 128), mesh, [Shard(0)] * mesh.ndim))
        opt = torch.optim.AdamW([w, b], lr=0.01)

        def step() -> None:
            (w.sum() + (b * b).sum()).backward()
            opt.step()
            opt.zero_grad()

        step()
        at_step, hook = _at_step(opt)
        state = {"w": w, "b": b, "opt": opt}
        directory = os.path.join(root, f"sharded{i}")
        with deepnvme.CheckpointManager(directory, staging="fenced", timeout=60) as mgr:
            real = _ranks.write_share
            _ranks.write_share = _writes_after(at_step, {})
            assert mgr.save(1, state)
            saved = (w.to_local().clone(), b.to_local().clone(), w.full_tensor())
            step()  # changes the shards: the fence copied them first
            assert not torch.equal(w.to_local(), saved[0])
            mgr.wait()
            _ranks.write_share = real
            stats = mgr.stats
            with torch.no_grad():
                w.to_local().zero_()
                b.to_local().zero_()
            assert mgr.restore(state) == 1
            assert torch.equal(w.to_local(), saved[0]) and torch.equal(b.to_local(), saved[1])
            assert torch.equal(w.full_tensor(), saved[2])
            assert stats.fence_copied_bytes >= w.to_local().nbytes, stats
        hook.remove()
        dist.barrier()
