"""What each rank runs in tests/distributed/test_manager_tiers.py (spawned, so module-level):
one directory per simulated node, replicas on the partner node, a durable directory."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import deepnvme
from deepnvme.checkpoint.manager import _durable, _replicas
from deepnvme.cli.main import main

from ._workers import model_and_optim, same, snapshot, train

STEP = "step-{:012d}"


class Records(logging.Handler):
    """The deepnvme log messages of this process, kept for assertions."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []
        logger = logging.getLogger("deepnvme")
        logger.addHandler(self)
        logger.setLevel(logging.INFO)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _zero(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()


def nodes_replicas_durable(rank: int, world: int, root: str, per_node: int) -> None:
    """Saves on ``world // per_node`` simulated nodes with replicas and a slow durable drain; one
    node's directory lost: restore from replicas; every node's lost: restore from durable; stock
    dcp.load of the durable step; a failed replica transfer raised by every rank at the next
    save, naming the rank; a step missing on every tier is not listed and its error names the
    tiers to configure."""
    log = Records()
    node = rank // per_node
    dirs = [os.path.join(root, f"node{n}") for n in range(world // per_node)]
    mine, lasting = dirs[node], os.path.join(root, "durable")
    model, opt = model_and_optim(ddp=True)
    state: dict[str, Any] = {"model": model, "optim": opt, "meta": {"epoch": 0}}
    real_copy = _durable.copy_file

    def slow(src: str, dst: str) -> None:  # a slow shared filesystem: the drain falls behind
        time.sleep(0.3)
        real_copy(src, dst)

    _durable.copy_file = slow
    opts: dict[str, Any] = {"keep": 2, "replicas": 2, "durable": lasting, "keep_durable": 2, "timeout": 30}
    mgr = deepnvme.CheckpointManager(mine, **opts)
    for step in (1, 2, 3):
        train(model, opt)
        state["meta"] = {"epoch": step}
        started = time.perf_counter()
        assert mgr.save(step, state)
        assert time.perf_counter() - started < 5.0  # save() never waits for the durable copy
    mgr.close()  # finishes step 3's save, its replication and its durable copy
    _durable.copy_file = real_copy
    expected = snapshot(model, opt)
    # each node: its own ranks' files, .metadata and a manifest naming every rank's files
    step3 = os.path.join(mine, STEP.format(3))
    with open(os.path.join(step3, "manifest.json")) as f:
        manifest = json.load(f)
    every = {n for r in manifest["ranks"] for n in r["files"]}
    assert sorted(manifest["files"]) == sorted([*every, ".metadata"])
    ours = {n for r in range(node * per_node, (node + 1) * per_node) for n in manifest["ranks"][r]["files"]}
    assert set(os.listdir(step3)) == {*ours, ".metadata", "manifest.json"}, os.listdir(step3)
    source = (rank - per_node) % world  # this rank keeps its source's replica
    copy = os.path.join(_replicas.replica_dir(mine, source), STEP.format(3))
    assert set(manifest["ranks"][source]["files"]) <= set(os.listdir(copy))
    assert sorted(os.listdir(_replicas.replica_dir(mine, source))) == [STEP.format(2), STEP.format(3)]  # keep=2
    assert sorted(n for n in os.listdir(mine) if n.startswith("step-")) == [STEP.format(2), STEP.format(3)]
    kept = sorted(n for n in os.listdir(lasting) if n.startswith("step-"))
    assert STEP.format(3) in kept and len(kept) <= 2, kept  # keep_durable=2; step 3 drained at close
    if len(kept) < 3 and STEP.format(2) not in kept:
        assert any("durable copy fell behind" in m for m in log.messages), log.messages
    if rank == 0:  # deepnvme verify checks a node's own files of each step, and the durable steps
        assert main(["verify", mine]) == 0 and main(["verify", lasting]) == 0
        victim = os.path.join(lasting, STEP.format(3), manifest["ranks"][world - 1]["files"][0])
        with open(victim, "rb") as f:
            good = f.read()
        os.truncate(victim, 10)
        assert main(["verify", lasting]) == 1  # the durable copy holds every rank's files
        with open(victim, "wb") as f:
            f.write(good)
    dist.barrier()

    # one node's directory is lost: its files come back from the replicas on the other node
    if rank == 0:
        shutil.rmtree(dirs[-1])
    dist.barrier()
    _zero(model)
    state["meta"] = {"epoch": -1}
    with deepnvme.CheckpointManager(mine, **opts) as mgr:
        assert mgr.latest_step() == 3
        assert mgr.restore(state) == 3
    got = snapshot(model, opt)
    assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])
    assert state["meta"] == {"epoch": 3}
    assert any("from the replica tier" in m for m in log.messages), log.messages
    dist.barrier()

    # every node's directory is lost: the durable tier holds the step
    if rank == 0:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    dist.barrier()
    _zero(model)
    with deepnvme.CheckpointManager(mine, **opts) as mgr:
        assert mgr.restore(state) == 3
    got = snapshot(model, opt)
    assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])
    assert any("from the durable tier" in m for m in log.messages), log.messages
    plain = {"model": {k: torch.zeros_like(v) for k, v in expected["model"].items()}}
    dcp.load(plain, checkpoint_id=os.path.join(lasting, STEP.format(3)))  # stock DCP reads it
    assert same(plain["model"], expected["model"])
    dist.barrier()

    # a failed replica transfer: committed, then every rank raises at the next save, naming the rank
    real_exchange = _replicas.exchange

    def failing(*args: Any, **kwargs: Any) -> BaseException | None:
        real_exchange(*args, **kwargs)
        return OSError(28, "No space left on device (injected)")

    _replicas.exchange = failing if rank == world - 1 else real_exchange
    fresh = os.path.join(root, f"again{node}")
    mgr = deepnvme.CheckpointManager(fresh, keep=2, replicas=2, timeout=30)
    assert mgr.save(10, state)
    try:
        mgr.save(11, state)
    except deepnvme.DeepNVMeIOError as exc:
        assert f"rank {world - 1}" in str(exc) and "replicating checkpoint step 10" in str(exc), exc
    else:
        raise AssertionError("the failed replication was not reported")
    _replicas.exchange = real_exchange
    mgr.close()
    if rank == 0:  # node 0 loses step 10: the failed replica was of one of its ranks' files
        shutil.rmtree(os.path.join(fresh, STEP.format(10)))
    dist.barrier()
    with deepnvme.CheckpointManager(fresh, timeout=30) as mgr:
        assert mgr.steps() == []  # not complete for every rank on any tier
        try:
            mgr.restore(state, step=10)
        except FileNotFoundError as exc:
            assert "replicas=2" in str(exc) and "durable=" in str(exc), exc
        else:
            raise AssertionError("a step missing on every tier was restored")


def heal_and_count(rank: int, world: int, root: str, per_node: int) -> None:
    """Restores across ``world // per_node`` simulated nodes, counting the bytes sent between
    them: with every node intact (with or without replicas) nothing travels (each shared read goes to a rank whose node
    holds the file); after node 0's directory is lost, it receives exactly its own ranks' files
    and those of the ranks it keeps replicas of (not the other nodes' files), rebuilds its copy
    of the step and its replicas, so that losing the last node afterwards is survivable too."""
    from deepnvme.checkpoint.manager import _tiers

    log = Records()
    node, nodes = rank // per_node, world // per_node
    dirs = [os.path.join(root, f"node{n}") for n in range(nodes)]
    mine = dirs[node]
    model, opt = model_and_optim(ddp=True)
    state: dict[str, Any] = {"model": model, "optim": opt, "meta": {"epoch": 0}}
    opts: dict[str, Any] = {"keep": 2, "replicas": 2, "timeout": 60}
    received: list[int] = []
    real_exchange = _tiers.exchange

    def counting(group: Any, *, send: Any, receive: Any, **kwargs: Any) -> BaseException | None:
        if receive is not None:
            received.append(receive.nbytes)
        return real_exchange(group, send=send, receive=receive, **kwargs)

    def per_node_received() -> list[int]:
        got: list[Any] = [None] * world
        dist.all_gather_object(got, sum(received))
        received.clear()
        return [sum(got[n * per_node:(n + 1) * per_node]) for n in range(nodes)]

    _tiers.exchange = counting
    # 0) no replicas: each node holds only its own ranks' files, yet nothing travels at restore
    plain = os.path.join(root, f"plain{node}")
    with deepnvme.CheckpointManager(plain, keep=1, timeout=60) as mgr:
        assert mgr.save(1, state)
    before = snapshot(model, opt)
    _zero(model)
    with deepnvme.CheckpointManager(plain, keep=1, timeout=60) as mgr:
        assert mgr.restore(state) == 1
    got = snapshot(model, opt)
    assert same(got["model"], before["model"]) and same(got["optim"], before["optim"])
    assert per_node_received() == [0] * nodes
    with deepnvme.CheckpointManager(mine, **opts) as mgr:
        for step in (1, 2):
            train(model, opt)
            state["meta"] = {"epoch": step}
            assert mgr.save(step, state)
    expected = snapshot(model, opt)
    with open(os.path.join(mine, STEP.format(2), "manifest.json")) as f:
        manifest = json.load(f)
    sizes, files_of = manifest["files"], [r["files"] for r in manifest["ranks"]]
    manifest_bytes = os.path.getsize(os.path.join(mine, STEP.format(2), "manifest.json"))

    def restored() -> None:
        got = snapshot(model, opt)
        assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])
        assert state["meta"] == {"epoch": 2}

    # 1) every node intact, the saving world size: no bytes travel between the nodes
    _zero(model)
    with deepnvme.CheckpointManager(mine, **opts) as mgr:
        assert mgr.restore(state) == 2
    restored()
    assert per_node_received() == [0] * nodes
    assert not [n for n in os.listdir(mine) if n.startswith(".step-")]  # the gathered directory is gone

    # 2) node 0's directory is lost: it gets its ranks' files and its replicas' sources' files whole
    dist.barrier()
    if rank == 0:
        shutil.rmtree(dirs[0])
    dist.barrier()
    _zero(model)
    with deepnvme.CheckpointManager(mine, **opts) as mgr:
        assert mgr.restore(state) == 2
    restored()
    ours = range(per_node)
    sources = {(r - per_node) % world for r in ours}
    wanted = sum(sizes[n] for r in {*ours, *sources} for n in files_of[r]) + sizes[".metadata"] + manifest_bytes
    got = per_node_received()
    assert got == [wanted] + [0] * (nodes - 1), (got, wanted)
    if nodes > 2:  # the other nodes' files did not travel
        assert wanted < sum(sizes.values()), (wanted, sizes)
    if node == 0:  # healed: its copy of the step and the replicas it keeps, complete
        healed = os.path.join(mine, STEP.format(2))
        assert set(os.listdir(healed)) == {*(n for r in ours for n in files_of[r]), ".metadata", "manifest.json"}
        for s in sources:
            copy = os.path.join(_replicas.replica_dir(mine, s), STEP.format(2))
            assert set(os.listdir(copy)) == {*files_of[s], ".metadata", "manifest.json"}
        if rank == 0:
            assert main(["verify", mine]) == 0
            assert any("rebuilt step 2" in m for m in log.messages), log.messages
    dist.barrier()

    # 3) a second loss: the last node, whose replicas node 0 keeps (rebuilt above)
    if rank == 0:
        shutil.rmtree(dirs[-1])
    dist.barrier()
    _zero(model)
    with deepnvme.CheckpointManager(mine, **opts) as mgr:
        assert mgr.latest_step() == 2
        assert mgr.restore(state) == 2
    restored()
    per_node_received()
    _tiers.exchange = real_exchange


def ranges(rank: int, world: int, root: str) -> None:
    """A file sent in part: only the given byte ranges travel; the receiver's copy has the
    full size, those bytes, and holes (zeros) elsewhere."""
    from deepnvme.checkpoint.manager._transfer import Transfer, exchange

    group = dist.new_group(backend="gloo")
    size, spans = 3 << 20, [(100, 1000), (1 << 20, 70000), ((3 << 20) - 10, 10)]
    src = os.path.join(root, "sent.bin")
    if rank == 0:
        data = os.urandom(size)
        with open(src, "wb") as f:
            f.write(data)
    dist.barrier()
    if rank == 0:
        out = Transfer(1, [(src, size), (src, size)], [spans, None])
        assert out.nbytes == 71010 + size
        assert exchange(group, send=out, receive=None, chunk=50000) is None
    elif rank == 1:
        into = Transfer(0, [(os.path.join(root, "part.bin"), size), (os.path.join(root, "whole.bin"), size)],
                        [spans, None])
        assert exchange(group, send=None, receive=into, chunk=50000) is None
        with open(src, "rb") as f:
            data = f.read()
        with open(os.path.join(root, "part.bin"), "rb") as f:
            part = f.read()
        assert len(part) == size
        expect = bytearray(size)
        for offset, length in spans:
            expect[offset:offset + length] = data[offset:offset + length]
        assert part == bytes(expect)
        with open(os.path.join(root, "whole.bin"), "rb") as f:
            assert f.read() == data
    dist.barrier()
