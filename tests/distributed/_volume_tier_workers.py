"""What each rank runs in tests/distributed/test_manager_volume.py for nodes on volumes (spawned,
so module-level): simulated nodes, each with its own volume of two drive directories."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

import deepnvme
from deepnvme import Volume, VolumeLayoutError
from deepnvme.checkpoint.manager import _replicas
from deepnvme.cli.main import main

from ._tier_workers import Records, _zero
from ._workers import model_and_optim, same, snapshot, train

STEP = "step-{:012d}"


def drives_of(root: str, node: int) -> list[str]:
    """The drive directories of simulated node ``node``."""
    return [os.path.join(root, f"node{node}-d{d}") for d in range(2)]


def _placed_files(folders: list[str]) -> dict[str, int]:
    """The data files of the step (or replica) folder on each drive: file -> drive."""
    out: dict[str, int] = {}
    for d, folder in enumerate(folders):
        for name in os.listdir(folder) if os.path.isdir(folder) else ():
            if name.endswith(".distcp"):
                assert name not in out, f"{name} lies on two drives"
                out[name] = d
    return out


def _manifest(folder: str, step: int) -> dict[str, Any]:
    with open(os.path.join(folder, STEP.format(step), "manifest.json")) as f:
        out: dict[str, Any] = json.load(f)
    return out


def _check_node(folders: list[str], ranks: list[int], manifest: dict[str, Any], sources: list[int],
                step: int) -> None:
    """A node's copy of ``step`` and its replicas: each of its ranks' files (and its sources'
    replicas) whole on one drive, named by the placement record in drive 0's folder."""
    files_of = [r["files"] for r in manifest["ranks"]]
    own = [os.path.join(f, STEP.format(step)) for f in folders]
    on = _placed_files(own)
    assert set(on) == {n for r in ranks for n in files_of[r]}, (on, ranks)
    with open(os.path.join(own[0], "deepnvme-placement.json")) as f:
        assert json.load(f)["files"] == on
    assert "deepnvme-placement.json" not in manifest["files"]  # each node's record is its own
    for source in sources:
        copy = [os.path.join(f, ".deepnvme-replicas", f"rank-{source:05d}", STEP.format(step)) for f in folders]
        got = _placed_files(copy)
        assert set(got) == set(files_of[source]), (got, source)
        with open(os.path.join(copy[0], "deepnvme-placement.json")) as f:
            assert json.load(f)["files"] == got
        assert {".metadata", "manifest.json"} <= set(os.listdir(copy[0]))
        on |= got
    # balanced by bytes, the replicas on top of the node's own files: each file went to the
    # drive holding the fewest bytes, so the drives differ by at most the largest file
    fill = [sum(manifest["files"][n] for n, d in on.items() if d == drive) for drive in range(len(folders))]
    assert max(fill) - min(fill) <= max(manifest["files"][n] for n in on), (on, fill)


def replicas_on_volumes(rank: int, world: int, root: str, per_node: int) -> None:
    """Nodes on volumes with replicas=2 (and durable=): every node's files and replicas placed on
    its own two drives; one node's drives lost entirely: restore reads the replicas, bitwise, and the node
    heals across its drives, so losing the other node afterwards is survivable too. A node
    opened with one drive missing is a VolumeLayoutError on every rank."""
    log = Records()
    nodes, node = world // per_node, rank // per_node
    vol = Volume(drives_of(root, node))
    model, opt = model_and_optim(ddp=True)
    state: dict[str, Any] = {"model": model, "optim": opt, "meta": {"epoch": 0}}
    opts: dict[str, Any] = {"keep": 2, "replicas": 2, "timeout": 30}
    lasting = os.path.join(root, "durable")
    with deepnvme.CheckpointManager(vol / "ck", **opts, durable=lasting, keep_durable=1) as mgr:
        for step in (1, 2, 3):
            train(model, opt)
            state["meta"] = {"epoch": step}
            assert mgr.save(step, state)
        mgr.wait()
        assert mgr.steps() == [2, 3] and mgr.latest_step() == 3
    expected = snapshot(model, opt)
    folders = [os.path.join(d, "ck") for d in drives_of(root, node)]
    manifest = _manifest(folders[0], 3)
    ranks = list(range(node * per_node, (node + 1) * per_node))
    sources = sorted({(r - per_node) % world for r in ranks})
    for step in (2, 3):
        _check_node(folders, ranks, _manifest(folders[0], step), sources, step)
    kept = [STEP.format(2), STEP.format(3)]
    for d, folder in enumerate(folders):  # retention on every drive, of the steps and of the replicas
        listed = [sorted(n for n in os.listdir(f) if "step-" in n) if os.path.isdir(f) else []
                  for f in [folder, *(_replicas.replica_dir(folder, s) for s in sources)]]
        assert all(names == kept if d == 0 else set(names) <= set(kept) for names in listed), (d, listed)
    if rank == 0:
        torch.save(expected, os.path.join(root, "expected.pt"))
        with open(os.path.join(root, "nodes.json"), "w") as f:
            json.dump(nodes, f)
    dist.barrier()

    # one drive of node 0 missing (not mounted): refused on every rank, naming the drive
    away = drives_of(root, 0)[1]
    if rank == 0:
        os.rename(away, away + "-away")
    dist.barrier()
    try:
        deepnvme.CheckpointManager(vol / "ck", **opts)
    except VolumeLayoutError as exc:
        assert "node0-d1" in str(exc) and "not mounted" in str(exc), exc
        assert node == 0 or "rank 0" in str(exc), exc
    else:
        raise AssertionError("a volume with a drive missing was opened")
    dist.barrier()
    if rank == 0:
        os.rename(away + "-away", away)
    dist.barrier()

    def restore(expect_replica: bool) -> None:
        _zero(model)
        state["meta"] = {"epoch": -1}
        with deepnvme.CheckpointManager(Volume(drives_of(root, node)) / "ck", **opts) as mgr:
            assert mgr.latest_step() == 3
            assert mgr.restore(state) == 3
        got = snapshot(model, opt)
        assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])
        assert state["meta"] == {"epoch": 3}
        assert not expect_replica or any("from the replica tier" in m for m in log.messages), log.messages
        log.messages.clear()

    # the last node loses both drives: its files come back from the replicas on node 0
    if rank == 0:
        for d in drives_of(root, nodes - 1):
            shutil.rmtree(d)
    dist.barrier()
    restore(True)
    if node == nodes - 1:  # healed: its step 3 and the replicas it keeps, across its drives again
        _check_node(folders, ranks, manifest, sources, 3)
    dist.barrier()
    # then node 0 loses both drives: the healed node holds what is needed
    if rank == 0:
        for d in drives_of(root, 0):
            shutil.rmtree(d)
    dist.barrier()
    restore(True)


def failed_commit_on_volumes(rank: int, world: int, root: str) -> None:
    """Two nodes on volumes, replicas=2, two data files per rank (so each node's step has a folder
    on both drives). Node 1's drive 0 fails to publish step 2 after its drive 1 published its
    folder: every rank raises, naming rank 1; step 2 is taken back on both nodes and every drive.
    Then node 1's drive 0 fails to publish the replica of step 3: raised on every rank, the
    replica's folder on drive 1 removed, step 3 stays committed. Step 1 restores bitwise; leftovers
    of a killed replica publish are removed at the first save."""
    from deepnvme.checkpoint.dcp import _storage
    from deepnvme.checkpoint.manager import _drives

    real_init = _storage.NVMeStorageWriter.__init__

    def two_files(self: Any, path: Any, **kwargs: Any) -> None:
        real_init(self, path, **{"thread_count": 2, **kwargs})

    _storage.NVMeStorageWriter.__init__ = two_files  # type: ignore[method-assign]
    node = rank
    folders = [os.path.join(d, "ck") for d in drives_of(root, node)]
    replicas = [_replicas.replica_dir(f, 1 - rank) for f in folders]
    crashed = os.path.join(replicas[1], STEP.format(9))
    os.makedirs(crashed)  # a step folder on drive 1 that drive 0 never listed
    model, opt = model_and_optim(ddp=True)
    state: dict[str, Any] = {"model": model, "optim": opt}
    mgr = deepnvme.CheckpointManager(Volume(drives_of(root, node)) / "ck", keep=3, replicas=2, timeout=30)
    train(model, opt)
    assert mgr.save(1, state)
    mgr.wait()
    expected = snapshot(model, opt)
    assert not os.path.exists(crashed)
    assert set(_placed_files([os.path.join(f, STEP.format(1)) for f in folders]).values()) == {0, 1}
    real = _drives.durable.publish_dir
    refused: list[str] = []

    def failing(src: str, dst: str) -> None:
        if dst in refused:
            raise OSError(28, "No space left on device (injected)")
        real(src, dst)

    _drives.durable.publish_dir = failing  # type: ignore[assignment]
    for step, target, what in ((2, folders[0], "checkpoint step 2"), (3, replicas[0], "replicating checkpoint step 3")):
        refused[:] = [os.path.join(target, STEP.format(step))] if rank == 1 else []
        train(model, opt)
        assert mgr.save(step, state)
        try:
            mgr.wait()
        except deepnvme.DeepNVMeIOError as exc:
            assert "rank 1" in str(exc) and what in str(exc), exc
        else:
            raise AssertionError(f"a failed publish of step {step} on node 1 was not reported")
        dist.barrier()
        for n in range(2):  # nothing of the failed step or replica is left on any drive
            for d in range(2):
                base = os.path.join(root, f"node{n}-d{d}", "ck")
                for folder in (base, _replicas.replica_dir(base, 1 - n)):
                    names = os.listdir(folder) if os.path.isdir(folder) else []
                    left = [x for x in names if x.startswith(".step-") or (x == STEP.format(2))
                            or (x == STEP.format(3) and folder != base and n == 1)]
                    assert not left, (folder, left)
    _drives.durable.publish_dir = real  # type: ignore[assignment]
    assert mgr.steps() == [1, 3]
    _zero(model)
    assert mgr.restore(state, step=1) == 1
    got = snapshot(model, opt)
    assert same(got["model"], expected["model"]) and same(got["optim"], expected["optim"])
    mgr.close()
    if rank == 0:  # deepnvme verify finds each data file on the drive the step's placement record names
        assert main(["verify", folders[0]]) == 0
        step1 = os.path.join(folders[1], STEP.format(1))
        os.truncate(os.path.join(step1, next(n for n in os.listdir(step1) if n.endswith(".distcp"))), 10)
        assert main(["verify", folders[0]]) == 1
