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
    """A steady-state save runs no planning exchange and, after the second save, no collective on
    the training thread and no DCP walk there, while the values at save() are saved; a change of
    structure plans again; a restore reads each replicated item on one rank and broadcasts it, bitwise."""
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
    assert ranks.plans.planned == 1 and [w for t, w in said if t == "main"] == ["save(1)", "save(1) planning"], said
    said.clear()
    arena = ranks._arenas.arenas()[0]  # this rank's share of the tensors, staged in one arena
    assert ranks.plans.cache is not None and arena is not None
    share = [i for i in ranks.plans.cache.final.items if i.tensor_data is not None]
    assert 0 < arena.numel() == sum(
        -(-(i.tensor_data.size.numel() * i.tensor_data.properties.dtype.itemsize) // 4096) * 4096 for i in share)
    train(model, opt)
    state["meta"] = {"epoch": 2}  # plain data changes value, not structure: the plan holds
    expected = snapshot(model, opt)
    assert mgr.save(2, state)
    with torch.no_grad():  # a snapshot: changes right after save() returns do not reach step 2
        for p in model.parameters():
            p.add_(1.0)
    mgr.wait()
    # held: no collective on this thread, the structure compared on the writer thread; save(2)
    # still walked in save() (the share's tensors are found on the writer thread of a held save)
    assert ranks.plans.planned == 1 and [w for t, w in said if t == "main"] == [], said
    assert [w for t, w in said if t == "writer"][0] == "save(2) structure", said
    assert (ranks.snapshots.walked, ranks.snapshots.fast) == (1, 0)
    again = ranks._arenas.arenas()[0]
    assert again is not None and again.data_ptr() == arena.data_ptr()  # the same arena, reused
    train(model, opt)
    expected3 = snapshot(model, opt)
    assert mgr.save(3, state)  # the steady state: the share copied in save() without DCP's walk
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
        for s in opt.state.values():
            s["exp_avg"].add_(1.0)
    mgr.wait()
    assert (ranks.snapshots.walked, ranks.snapshots.fast, ranks.plans.planned) == (1, 1, 1)
    assert ranks._arenas.arenas()[0].data_ptr() == arena.data_ptr()
    state["extra"] = torch.full((5,), float(rank == 0))  # a new entry: planned again
    assert mgr.save(4, state)
    mgr.wait()
    assert ranks.plans.planned == 2 and ranks.snapshots.walked == 2
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
    assert mgr.restore(state, step=3) == 3
    got = snapshot(model, opt)
    assert same(got["model"], expected3["model"]) and same(got["optim"], expected3["optim"])
    counts: list[Any] = [None] * world
    dist.all_gather_object(counts, read[0])
    assert asked[0] == sum(counts) and max(counts) < 0.7 * asked[0], (counts, asked)  # each item read once
    mgr.close()
    assert [n for n in sorted(os.listdir(directory)) if n.startswith("step-")] == [
        f"step-{s:012d}" for s in (2, 3, 4)]


def _dtensors(world: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """DTensor state on a 1-D and a 2-D CPU mesh (sharded, and replicated over one mesh
    dimension), a plain replicated tensor and plain data; and the full values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    flat = init_device_mesh("cpu", (world,))
    square = init_device_mesh("cpu", (2, world // 2))
    torch.manual_seed(0)
    full = {"a": torch.randn(16, 8), "b": torch.randn(12, 6), "c": torch.randn(10), "r": torch.arange(6.0)}
    state: dict[str, Any] = {"a": distribute_tensor(full["a"], flat, [Shard(0)]),
                             "b": distribute_tensor(full["b"], square, [Shard(0), Shard(1)]),
                             "c": distribute_tensor(full["c"], square, [Replicate(), Shard(0)]),
                             "r": full["r"].clone(), "info": {"k": 1}}
    return state, full


def meshes(rank: int, world: int, directory: str, out: str) -> None:
    """DTensors on 1-D and 2-D meshes with checksums: bitwise round trip, every item checked as read."""
    state, full = _dtensors(world)
    with deepnvme.CheckpointManager(directory, checksums="crc32c", timeout=60) as mgr:
        assert mgr.save(1, state)
        mgr.wait()
        for name in ("a", "b", "c"):
            state[name].to_local().zero_()
        state["r"].zero_()
        state["info"] = {"k": 0}  # plain data restores into the same structure (DCP)
        checked: list[int] = []
        real = _storage.NVMeStorageReader._read_plan

        def counted(self: NVMeStorageReader, plan: Any, planner: Any) -> None:
            real(self, plan, planner)
            checked.append(0 if self.item_sums is None else self.item_sums.checked)

        _storage.NVMeStorageReader._read_plan = counted  # type: ignore[method-assign]
        assert mgr.restore(state) == 1
        _storage.NVMeStorageReader._read_plan = real  # type: ignore[method-assign]
        assert checked and checked[0] > 0
        for name in ("a", "b", "c"):
            assert torch.equal(state[name].full_tensor(), full[name]), name
        assert torch.equal(state["r"], full["r"]) and state["info"] == {"k": 1}
    if rank == 0:
        torch.save(full, out)


def resharded(rank: int, world: int, directory: str, out: str) -> None:
    """A step saved by 4 ranks restored by ``world`` ranks into other placements, and by stock dcp.load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full = torch.load(out, weights_only=True)
    mesh = init_device_mesh("cpu", (world,))
    state: dict[str, Any] = {"a": distribute_tensor(torch.zeros(16, 8), mesh, [Shard(1)]),
                             "b": distribute_tensor(torch.zeros(12, 6), mesh, [Replicate()]),
                             "c": distribute_tensor(torch.zeros(10), mesh, [Shard(0)]),
                             "r": torch.zeros(6), "info": {"k": 0}}
    with deepnvme.CheckpointManager(directory, checksums="crc32c", timeout=60) as mgr:
        assert mgr.restore(state) == 1  # RNG states of 4 ranks are left alone here, with a warning
    for name in ("a", "b", "c"):
        assert torch.equal(state[name].full_tensor(), full[name]), name
    assert torch.equal(state["r"], full["r"]) and state["info"] == {"k": 1}
    plain = {name: torch.zeros_like(full[name]) for name in ("a", "b", "c", "r")}
    dcp.load(plain, checkpoint_id=os.path.join(directory, "step-000000000001"))
    assert all(torch.equal(plain[k], full[k]) for k in plain)


def killed(rank: int, world: int, directory: str, phase: str) -> None:
    """Step 1 committed, then the job dies (SIGKILL) at ``phase`` of step 2's save."""
    import signal

    from deepnvme.checkpoint.manager import _ranks

    model, opt = model_and_optim(ddp=True)
    state = {"model": model, "optim": opt}
    mgr = deepnvme.CheckpointManager(directory, keep=1, checksums="crc32c", timeout=30)
    assert mgr.save(1, state)
    mgr.wait()
    if rank == 0:
        torch.save(snapshot(model, opt), os.path.join(directory, "expected-1.pt"))
    train(model, opt)
    if rank == 0:
        torch.save(snapshot(model, opt), os.path.join(directory, "expected-2.pt"))
    dist.barrier()

    def stop(at: str) -> None:
        if at == phase:
            os.kill(os.getpid(), signal.SIGKILL)

    _ranks.at_phase = stop
    mgr.save(2, state)
    mgr.wait()
    raise AssertionError(f"rank {rank} was not killed at {phase!r}")


def restart(rank: int, world: int, directory: str, newest: int) -> None:
    """After a killed job: the newest listed step is ``newest``, complete, and restores bitwise;
    what the killed save left is removed and saving goes on."""
    model, opt = model_and_optim(ddp=True)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state = {"model": model, "optim": opt}
    with deepnvme.CheckpointManager(directory, keep=1, checksums="crc32c", timeout=30) as mgr:
        assert mgr.latest_step() == newest, mgr.steps()
        assert mgr.restore(state) == newest
        expected = torch.load(os.path.join(directory, f"expected-{newest}.pt"), weights_only=True)
        got = snapshot(model, opt)
        assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])
        assert mgr.save(3, state)
        mgr.wait()
        assert mgr.steps() == [3]
    dist.barrier()
    assert not [n for n in os.listdir(directory) if n.startswith(".step-")], os.listdir(directory)


def flipped(rank: int, world: int, directory: str, where: str) -> None:
    """A flipped byte in rank 1's file (inside a tensor's bytes, or an item's header): restore(step=2)
    fails on every rank naming the file; restore() falls back to step 1 on every rank."""
    model, opt = model_and_optim(ddp=True)
    state = {"model": model, "optim": opt}
    with deepnvme.CheckpointManager(directory, checksums="crc32c", timeout=30) as mgr:
        assert mgr.save(1, state)
        mgr.wait()
        expected = snapshot(model, opt)
        train(model, opt)
        assert mgr.save(2, state)
        mgr.wait()
        path = os.path.join(directory, "step-000000000002", "__1_0.distcp")
        with open(os.path.join(directory, "step-000000000002", "manifest.json")) as f:
            manifest = __import__("json").load(f)
        assert set(manifest["file_checksums"]) == set(manifest["files"])
        assert len(manifest["tensor_checksums"]) >= len(expected["model"])
        if rank == 1:  # the sums written match the files' bytes
            from deepnvme.checkpoint.manager._checksums import file_checksum

            for name, value in manifest["file_checksums"].items():
                assert file_checksum("crc32c", os.path.join(directory, "step-000000000002", name)) == value
            at = os.path.getsize(path) // 2 if where == "data" else 10  # 10: the first item's zip header
            with open(path, "r+b") as f:
                f.seek(at)
                byte = f.read(1)
                f.seek(at)
                f.write(bytes([byte[0] ^ 0xFF]))
        dist.barrier()
        try:
            mgr.restore(state, step=2)
        except deepnvme.CheckpointCorruptError as exc:
            assert "step 2" in str(exc) and "__1_0.distcp" in str(exc), exc
        else:
            raise AssertionError("the corrupt step was restored")
        assert mgr.restore(state) == 1
        got = snapshot(model, opt)
        assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])
