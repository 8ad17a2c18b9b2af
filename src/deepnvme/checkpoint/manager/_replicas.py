"""Replicas of a multi-node step: each rank's files copied to its partner's node (``replicas=2``).

After a step commits on every node, each rank sends its files of the step to its partner
(``rank + local world size``, on another node) over the manager's gloo group
(:mod:`._transfer`), while receiving its source's files. The receiver keeps them apart from its
node's own steps, so they never look like one::

    DIR/.deepnvme-replicas/rank-00001/step-000000000004/   rank 1's files, .metadata, manifest.json

built under a hidden name and published in one rename, as a step is (``.metadata`` and the
manifest are linked from the node's own copy of the step, which is identical on every node).
On a volume (:mod:`._node_folders`) the replica folder exists on every drive of the receiving
node: the replicas of the node's sources are placed on its drives balanced by bytes, on top of
the node's own files of the step, every rank of the node computing the same placement; drive 0's
folder (with a placement record) is published last.
Retention keeps the same number of replicas as steps. Runs on the manager's writer thread, so a
save's replication ends before the next save starts; the ranks vote on the outcome, and a
failure is raised by every rank at its next ``save()``, ``wait()`` or ``close()``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ._group import RankGroup
from ._node_folders import SHARED, NodeFolders
from ._nodes import Layout
from ._policy import retention_victims
from ._steps import list_steps, read_manifest, step_dir
from ._transfer import Transfer, exchange, link_or_copy
from ._votes import describe, failed

__all__ = ["REPLICAS", "replica_dir", "replicate"]

log = logging.getLogger(__name__)

REPLICAS = ".deepnvme-replicas"


def replica_dir(directory: str, rank: int) -> str:
    """Where a node keeps the replicas of rank ``rank``'s files."""
    return os.path.join(directory, REPLICAS, f"rank-{rank:05d}")


def replicate(g: RankGroup, layout: Layout, folders: NodeFolders, step: int, keep: int | None,
              tidied: set[int]) -> None:
    """The writer thread, after ``step`` committed on every node: send this rank's files to its
    partner, receive and publish its source's (see the module), vote; raise the same error on
    every rank when any failed (the step itself stays committed). ``folders``: this node's.
    ``tidied``: the source ranks whose replica folder had its leftovers removed already (updated)."""
    directory = folders.directory
    source = (g.rank - layout.local_world) % g.world
    local = step_dir(directory, step)
    target = replica_dir(directory, source)
    own: BaseException | None = None
    building: str | None = None
    placed: dict[str, int] = {}
    send = receive = None
    try:
        manifest = read_manifest(local, step)
        files, ranks = manifest["files"], manifest["ranks"]
        found = folders.files(local)
        send = Transfer(g.ranks[layout.partner(g.rank)],
                        [(found.get(n, os.path.join(local, n)), files[n]) for n in ranks[g.rank]["files"]])
        if source not in tidied:
            os.makedirs(target, exist_ok=True)
            folders.remove_leftovers(target)
            tidied.add(source)
        building = folders.building(target, step)
        placed = {n: d for n, d in _placement(folders, layout, manifest, found).items() if n in ranks[source]["files"]}
        receive = Transfer(g.ranks[source], [(folders.slot(building, n, placed[n]), files[n])
                                             for n in ranks[source]["files"]])
        for name in SHARED:
            link_or_copy(os.path.join(local, name), os.path.join(building, name))
    except BaseException as exc:  # the exchange below still runs, so no rank waits for this one
        own = exc
    if send is None:  # nothing known to send: the partner still expects the chunks of our files
        send = _placeholder(g, layout, directory, step)
    if receive is None:
        receive = Transfer(g.ranks[source], _expected(directory, step, source))
    got = exchange(g.group("writer"), send=send, receive=receive)
    own = own or got
    if own is None and building is not None:
        try:
            folders.seal(building, placed, step_dir(target, step))
            folders.publish(building, target, step)
        except BaseException as exc:
            own = exc
    if own is not None and building is not None:
        folders.discard(building, target, step)
    votes = g.gather(describe(own), thread="writer", what=f"step {step} replication")
    if any(votes):
        raise failed(f"replicating checkpoint step {step} (committed on every node; its replica is not) "
                     f"from rank r to rank r + {layout.local_world}", votes, own)
    _retire(folders, target, keep)


def _placement(folders: NodeFolders, layout: Layout, manifest: dict[str, Any], found: dict[str, str]
               ) -> dict[str, int]:
    """The drive of every replica file this node receives of a step (its ranks' sources' files),
    balanced by bytes on top of the node's own files of the step (``found``: name -> path); the
    same on every rank of the node."""
    sources = sorted({(r - layout.local_world) % layout.world for r in layout.nodes[layout.node]})
    sizes = {n: int(manifest["files"][n]) for s in sources for n in manifest["ranks"][s]["files"]}
    return folders.place(sizes, used=folders.fill({n: p for n, p in found.items() if n not in SHARED}))


def _expected(directory: str, step: int, rank: int) -> list[tuple[str, int]]:
    """Rank ``rank``'s files of ``step`` as ``(os.devnull, size)``: received and dropped when
    this rank cannot store them (its error is voted)."""
    try:
        manifest = read_manifest(step_dir(directory, step), step)
        return [(os.devnull, manifest["files"][n]) for n in manifest["ranks"][rank]["files"]]
    except BaseException:  # no manifest here either: the partner's sizes cannot be known
        return []


def _placeholder(g: RankGroup, layout: Layout, directory: str, step: int) -> Transfer:
    """What this rank sends when it cannot read its own step: its files' sizes, as far as known."""
    return Transfer(g.ranks[layout.partner(g.rank)], _expected(directory, step, g.rank))


def _retire(folders: NodeFolders, folder: str, keep: int | None) -> None:
    """Delete the oldest replicas in ``folder`` beyond ``keep`` (failures logged)."""
    for old in retention_victims(list_steps(folder), keep):
        try:
            folders.delete(folder, old)
        except OSError as exc:
            log.error("deepnvme.CheckpointManager: could not remove the replica of step %d in %r: %s", old,
                      folder, exc)
            return
