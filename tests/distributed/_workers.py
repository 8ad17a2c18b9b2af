"""What each rank runs in tests/distributed/test_manager_ranks.py (spawned, so module-level)."""

from __future__ import annotations

import errno
import json
import os
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.nn.parallel import DistributedDataParallel

import deepnvme
from deepnvme.checkpoint.manager import _ranks
from deepnvme.errors import DeepNVMeIOError, RanksTimeoutError


def model_and_optim(*, ddp: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The same small model on every rank (a seed), trained one step so AdamW has state."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(96, 96) for _ in range(6)])
    model: torch.nn.Module = DistributedDataParallel(net) if ddp else net
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train(model, opt)
    return model, opt


def train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    model(torch.randn(4, 96)).sum().backward()
    opt.step()
    opt.zero_grad()
    sync_replicas(model, opt)


def sync_replicas(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """Make every rank's parameters and optimizer state rank 0's, bitwise (no-op in one process or
    for DTensor state). A replicated tensor is written once, from one rank, and every rank restores
    that copy, so bitwise checks need identical replicas; DDP replicas can differ in the last bits
    after a step (seen: 1 fresh 2-rank job in ~20 on a loaded machine, the first layer's weight
    off by 3e-6)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    tensors = [p for group in opt.param_groups for p in group["params"]]
    tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    tensors += list(model.buffers())
    with torch.no_grad():
        for t in tensors:
            if not hasattr(t, "to_local"):
                dist.broadcast(t.data, 0)


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, object]:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return {"model": {k: v.clone() for k, v in inner.state_dict().items()},
            "optim": {k: v.clone() for k, v in _flat(get_optimizer_state_dict(model, opt)).items()}}


def _flat(sd: dict[str, object], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[f"{prefix}{k}"] = v
    return out


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def replicated(rank: int, world: int, directory: str) -> None:
    """DDP replicas: async saves, bytes per rank, a failure on one rank, bitwise restore, stock DCP."""
    model, opt = model_and_optim(ddp=True)
    state = {"model": model, "optim": opt, "meta": {"epoch": 3, "name": "run"}}
    mgr = deepnvme.CheckpointManager(directory, keep=2, timeout=30)
    assert mgr.save(1, state)
    train(model, opt)
    torch.manual_seed(100 + rank)  # RNG differs per rank
    real, gate = _ranks.write_share, threading.Event()

    def held(*args: Any, **kwargs: Any) -> Any:
        assert gate.wait(20)
        return real(*args, **kwargs)

    _ranks.write_share = held
    assert mgr.save(2, state)  # returns while the write is held: this rank's share is staged
    expected = snapshot(model, opt)
    draw = torch.rand(3)
    with torch.no_grad():  # training goes on; the step keeps what save() saw
        for p in model.parameters():
            p.add_(1.0)
    gate.set()
    mgr.wait()
    _ranks.write_share = real
    assert mgr.steps() == [1, 2] and mgr.latest_step() == 2
    path = os.path.join(directory, "step-000000000002")
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["world_size"] == world and manifest["layout"] == "dcp"
    shares = [r["bytes"] for r in manifest["ranks"]]
    assert max(shares) <= 1.25 * sum(shares) / world, shares  # replicated tensors split ~1/W
    assert sorted(manifest["files"]) == sorted([".metadata", *(f"__{r}_0.distcp" for r in range(world))])
    if rank == 0:
        torch.save(expected, os.path.join(directory, "expected.pt"))

    # a write failure on rank 1 fails step 3 on every rank; steps 1 and 2 stay
    def failing(*args: object, **kwargs: object) -> object:
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    _ranks.write_share = failing if rank == 1 else real
    train(model, opt)
    assert mgr.save(3, state)
    try:
        mgr.save(4, state)  # a due save waits for the previous one: every rank raises its error here
    except DeepNVMeIOError as exc:
        assert "rank 1" in str(exc) and exc.errno == errno.ENOSPC, exc
    else:
        raise AssertionError("the failed save was not reported")
    _ranks.write_share = real
    mgr.wait()
    assert mgr.steps() == [1, 2]
    dist.barrier()
    assert not [n for n in os.listdir(directory) if n.startswith(".step-")]

    # restore: bitwise, into the live model and optimizer, RNG per rank
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    state["meta"] = {"epoch": 0, "name": ""}
    torch.manual_seed(999)
    assert mgr.restore(state) == 2
    got = snapshot(model, opt)
    assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])
    assert state["meta"] == {"epoch": 3, "name": "run"}
    assert torch.equal(torch.rand(3), draw)

    # stock torch.distributed.checkpoint reads the step
    plain = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    dcp.load(plain, checkpoint_id=path)
    assert same(plain["model"], expected["model"])

    # retention (keep=2) after a newer step committed
    assert mgr.save(4, state)
    mgr.close()
    assert sorted(n for n in os.listdir(directory) if n.startswith("step-")) == [
        "step-000000000002", "step-000000000004"]


def sharded(rank: int, world: int, directory: str, single: str) -> None:
    """DTensor shards on a 1-D CPU mesh: each rank writes its shard; bitwise restore; a step saved
    by one process restores into every rank; a rank that does not answer is named in the timeout."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = torch.randn(64, 32)
    w = distribute_tensor(full, mesh, [Shard(0)])
    state = {"w": w, "info": {"step": 7}}
    with deepnvme.CheckpointManager(directory, timeout=30) as mgr:
        assert mgr.save(5, state)
        mgr.wait()
        mine = w.to_local().clone()
        w.to_local().zero_()
        assert mgr.restore(state) == 5
        assert torch.equal(w.to_local(), mine) and torch.equal(w.full_tensor(), full)
        with open(os.path.join(directory, "step-000000000005", "manifest.json")) as f:
            shares = [r["bytes"] for r in json.load(f)["ranks"]]
        assert min(shares) >= full.numel() * full.element_size() / world  # each rank wrote its shard
    with deepnvme.CheckpointManager(single, timeout=30) as mgr:
        got = {"t": torch.zeros(5), "note": ""}
        assert mgr.restore(got) == 1
        assert torch.equal(got["t"], torch.arange(5.0)) and got["note"] == "one process"
    lonely = deepnvme.CheckpointManager(directory, timeout=3)
    if rank == 0:
        try:
            lonely.steps()  # rank 1 never calls it
        except RanksTimeoutError as exc:
            assert "1" in str(exc).split("gloo says:")[1], exc
        else:
            raise AssertionError("no timeout")


def checked(rank: int, world: int, directory: str, single: str) -> None:
    """checksums= and rank_state= across ranks: per-file sums in the manifest, each rank's own
    state back, a flipped byte in one rank's file fails restore(step=N) on every rank and
    restore() falls back to the previous step on every rank; a single-process step's rank_state
    refused at another world size unless skipped."""
    import logging

    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    logging.getLogger("deepnvme").addHandler(Keep(logging.WARNING))
    model, opt = model_and_optim(ddp=True)
    state = {"model": model, "optim": opt}
    with deepnvme.CheckpointManager(directory, checksums="xxh64", timeout=30) as mgr:
        for step in (1, 2):
            assert mgr.save(step, state, rank_state={"pos": 10 * rank + step, "seen": torch.full((3,), rank)})
        mgr.wait()
        expected = snapshot(model, opt)
        with open(os.path.join(directory, "step-000000000002", "manifest.json")) as f:
            manifest = json.load(f)
        assert manifest["checksum"] == "xxh64" and sorted(manifest["file_checksums"]) == sorted(manifest["files"])
        assert manifest["rank_state"] == {f"rank{r}": ["pos", "seen"] for r in range(world)}
        mine: dict[str, Any] = {"pos": -1, "other": "kept"}
        assert mgr.restore(state, step=2, rank_state=mine) == 2
        assert mine["pos"] == 10 * rank + 2 and torch.equal(mine["seen"], torch.full((3,), rank))
        assert mine["other"] == "kept"
        try:  # a held save (DCP's walk on the writer thread): reported at wait()
            mgr.save(3, {**state, "_deepnvme_rank_state": 1})
            mgr.wait()
        except deepnvme.DistributedSaveError as exc:
            assert "reserved" in str(exc) and "rank 0, 1" in str(exc), exc
        else:
            raise AssertionError("a reserved key was saved")
        # stock DCP still reads the step
        plain = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
        dcp.load(plain, checkpoint_id=os.path.join(directory, "step-000000000002"))
        assert same(plain["model"], expected["model"])
        if rank == 1:  # one byte of rank 1's file of step 2 flips
            path = os.path.join(directory, "step-000000000002", "__1_0.distcp")
            with open(path, "r+b") as f:
                f.seek(os.path.getsize(path) // 2)
                byte = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([byte[0] ^ 0xFF]))
        dist.barrier()
        try:
            mgr.restore(state, step=2)
        except deepnvme.CheckpointCorruptError as exc:
            assert "step 2" in str(exc) and "__1_0.distcp" in str(exc) and "xxh64" in str(exc), exc
        else:
            raise AssertionError("the corrupt step was restored")
        mine = {}
        assert mgr.restore(state, rank_state=mine) == 1  # the newest step is skipped on every rank
        assert mine["pos"] == 10 * rank + 1
        assert any("skipping checkpoint step 2" in r for r in records), records
        assert get_model_state_dict(model).keys() == expected["model"].keys()
    with deepnvme.CheckpointManager(single, timeout=30) as mgr:
        target = {"t": torch.zeros(2)}
        try:
            mgr.restore(target, rank_state={})
        except deepnvme.CheckpointMismatchError as exc:
            assert "'cursor'" in str(exc) and "skip" in str(exc), exc
        else:
            raise AssertionError("a single-process rank_state was given to 2 ranks")
        assert mgr.restore(target, rank_state="skip") == 1 and torch.equal(target["t"], torch.ones(2))
