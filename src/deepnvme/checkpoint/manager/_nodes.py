"""Nodes of a manager spanning several ranks: ranks that pass the same ``directory`` on the same
host form a node, and each node keeps its own copy of every step it took part in.

A step of several nodes is published per node (:func:`publish_nodes`): after the ranks' vote,
every node's hidden building directory holds the files of that node's ranks; rank 0 writes
``.metadata`` and the manifest (listing every rank's files, on whichever node, with their sizes)
and sends both to the other nodes, so each node's ``step-N`` is self-describing: it says what
the whole step holds and which of those files it has. Then every node renames its directory
into place; a node that fails makes the others take their step back. A step is listed only
where every rank's files are on some node or tier (:mod:`._tiers`), so a crash between two
nodes' renames leaves a step that no listing shows. A node on a volume (:mod:`._node_folders`)
places its ranks' files on its own drives and records where in its own placement record, which
the shared manifest does not list (each node's differs).
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ._group import RankGroup
from ._node_folders import NodeFolders
from ._steps import MANIFEST, list_steps, step_dir
from ._votes import Failure, describe

__all__ = ["Layout", "discover", "publish_nodes", "retire_nodes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """Which ranks (group ranks) share a node, and this rank's place among them."""

    rank: int
    nodes: tuple[tuple[int, ...], ...]  # ranks of each node, ascending; nodes ordered by first rank

    @property
    def world(self) -> int:
        return sum(len(n) for n in self.nodes)

    @property
    def node(self) -> int:
        """The index of this rank's node."""
        return self.node_of(self.rank)

    def node_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.nodes) if rank in ranks)

    @property
    def leader(self) -> bool:
        """Whether this rank does its node's directory work (it is the node's lowest rank)."""
        return self.nodes[self.node][0] == self.rank

    @property
    def leaders(self) -> list[int]:
        return [ranks[0] for ranks in self.nodes]

    @property
    def local_world(self) -> int:
        return len(self.nodes[self.node])

    def partner(self, rank: int) -> int:
        """The rank that keeps ``rank``'s replica: ``rank + local_world``, modulo the world."""
        return (rank + self.local_world) % self.world

    def check_replicas(self) -> None:
        """``ValueError`` unless every rank's partner is on another node."""
        same = [r for r in range(self.world) if self.node_of(self.partner(r)) == self.node_of(r)]
        if len(self.nodes) < 2 or same:
            raise ValueError(
                f"CheckpointManager(replicas=2): each rank's replica goes to rank + local world size "
                f"({self.local_world}) on another node, but the nodes (ranks sharing a host and "
                f"directory) are {[list(n) for n in self.nodes]}: give each node its own directory or volume, "
                "with the same number of consecutive ranks on every node, or use replicas=1")


def discover(group: RankGroup, directory: str) -> Layout:
    """Collective (the caller's thread): the nodes, from every rank's host name and directory."""
    keys = group.gather((socket.gethostname(), os.path.realpath(directory)), thread="main",
                        what="CheckpointManager() nodes")
    order: dict[tuple[str, str], list[int]] = {}
    for r, key in enumerate(keys):
        order.setdefault(tuple(key), []).append(r)
    return Layout(rank=group.rank, nodes=tuple(tuple(ranks) for ranks in order.values()))


def _sizes(folders: NodeFolders, building: str) -> dict[str, int]:
    return {n: os.path.getsize(p) for n, p in folders.files(building).items() if n != MANIFEST}


def publish_nodes(g: RankGroup, layout: Layout, *, folders: NodeFolders, building: str, step: int,
                  finish: Callable[[], None], placed: Mapping[str, int]
                  ) -> tuple[list[Failure | None], BaseException | None]:
    """The writer thread, after every rank wrote its files: commit ``step`` on every node (see
    the module). ``finish()`` (rank 0) writes ``.metadata`` and the manifest into ``building``.
    ``placed``: on a volume, this node's data files -> drive. Returns every rank's failure (all
    None: committed everywhere) and this rank's own error."""
    own: BaseException | None = None
    sizes: dict[str, int] | None = None
    directory = folders.directory
    if layout.leader:
        try:
            sizes = _sizes(folders, building)
        except OSError as exc:
            own = exc
    reports = g.gather((sizes, describe(own)), thread="writer", what=f"step {step} files")
    payload: tuple[bytes, bytes] | None = None
    if g.rank == 0 and not any(f for _, f in reports):
        try:
            finish()
            manifest_path = os.path.join(building, MANIFEST)
            with open(manifest_path, encoding="utf-8") as text_in:
                manifest = json.load(text_in)
            manifest["files"] = dict(sorted({n: s for got, _ in reports if got for n, s in got.items()}.items()))
            manifest["files"][".metadata"] = os.path.getsize(os.path.join(building, ".metadata"))
            manifest["nodes"] = [list(ranks) for ranks in layout.nodes]
            text = json.dumps(manifest, indent=1).encode()
            with open(manifest_path, "wb") as out:
                out.write(text)
            with open(os.path.join(building, ".metadata"), "rb") as meta:
                payload = (meta.read(), text)
        except BaseException as exc:
            own = exc
    sent = g.gather((payload, describe(own)) if g.rank == 0 else None, thread="writer",
                    what=f"step {step} metadata")[0]
    published = False
    if layout.leader and sent[0] is not None and own is None:
        try:
            if g.rank != 0:
                for name, data in ((".metadata", sent[0][0]), (MANIFEST, sent[0][1])):
                    with open(os.path.join(building, name), "wb") as out:
                        out.write(data)
            folders.seal(building, placed, step_dir(directory, step))
            folders.publish(building, directory, step)
            published = True
        except BaseException as exc:
            own = exc
    failures = [r[1] for r in reports]
    if sent[0] is None:
        failures[0] = failures[0] or sent[1]
    outcome = g.gather(describe(own), thread="writer", what=f"step {step} commit")
    failures = [f or o for f, o in zip(failures, outcome)]
    if any(failures) and layout.leader:  # take the step back where it was published
        try:
            if published:
                folders.delete(directory, step)
            else:
                folders.discard(building, directory, step)
        except OSError as exc:
            log.error("deepnvme.CheckpointManager: could not take back step %d in %r after a failed "
                      "commit on another node: %s", step, directory, exc)
    return failures, own


def retire_nodes(g: RankGroup, layout: Layout, folders: NodeFolders, keep: int | None) -> None:
    """The writer thread, after a commit: each node removes its steps that are neither among the
    newest ``keep`` complete on every node nor newer than the newest of those (a step another
    node never published). Failures are logged; the next commit tries again."""
    directory = folders.directory
    mine = list_steps(directory) if layout.leader else None
    lists = [set(s) for s in g.gather(mine, thread="writer", what="retention") if s is not None]
    complete = sorted(set.intersection(*lists)) if lists else []
    if keep is None or not complete or mine is None:
        return
    kept = set(complete[-keep:])
    for old in [s for s in mine if s not in kept and s < complete[-1]]:
        try:
            folders.delete(directory, old)
        except OSError as exc:
            log.error("deepnvme.CheckpointManager: could not remove step %d from %r (keep=%s): %s; "
                      "the next save tries again", old, directory, keep, exc)
            return
