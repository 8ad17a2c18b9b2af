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
