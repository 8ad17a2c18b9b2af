"""Where a multi-rank manager finds a step to restore: the tiers (see docs/checkpoints.md).

* **local**: each node's own ``step-N`` (:mod:`._nodes`);
* **replica**: the copies of other nodes' files a node keeps (:mod:`._replicas`);
* **durable**: ``durable=PATH``, every rank's files in one directory all ranks see (:mod:`._durable`).

A listing (:meth:`Tiers.survey`) is collective: each node reports which files of which steps
it holds (in its own steps and its replicas), rank 0 the durable steps; a step is listed when
every file its manifest names is on some node, or when the durable tier holds it. To restore a
step from the nodes (:meth:`Tiers.prepare`), each node whose own directory lacks some of the
step's files gathers them in a hidden directory: hard links to what it holds, the rest received
over the manager's gloo group from a node holding it (:mod:`._transfer`), so no shared storage
is needed; DCP then reads that directory. At the saving world size the ranks plan their reads
first (each shared read to a rank whose node holds the file) and only the byte ranges a node's
ranks read travel, into sparse files; a node whose own copy of the step was lost gets its ranks'
files and its replicas' whole, and republishes them once the step is restored (it heals). Only
where the nodes together lack some file does the durable tier serve the step (all ranks read it
there; any world size). On a volume (:mod:`._node_folders`) a node's files of a step, its
replicas and its gathering folder lie on its drives, each file whole on one, and the gathering
folder gets a placement record naming where each file is, so DCP reads it as a volume folder.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata

from ...errors import CheckpointCorruptError, FileNotFoundIOError
from .._placed import PLACEMENT_NAME
from ._dcp_step import ReadHints
from ._drives import StepDrives
from ._group import RankGroup
from ._node_folders import SHARED, NodeFolders
from ._nodes import Layout
from ._replicas import REPLICAS, replica_dir
from ._steps import MANIFEST, list_steps, read_manifest, step_dir
from ._transfer import Ranges, Transfer, exchange, link_or_copy
from ._votes import describe, failed

__all__ = ["Reads", "Source", "Survey", "Tiers"]

Reads = Callable[[Metadata, dict[str, frozenset[int]]], "list[list[tuple[str, int, int]]] | None"]
"""Collective: given a step's metadata and which ranks hold each data file locally, the
``(file, offset, length)`` ranges each rank will read (None: unknown, whole files travel)."""

log = logging.getLogger(__name__)

# step -> (required, present sizes, own dir whole, names in the node's own step-N)
Holding = dict[int, tuple[list[str], dict[str, int], bool, list[str]]]


@dataclass(frozen=True)
class Survey:
    """What every node holds (by group rank; None for ranks that are not a node's leader) and
    the durable tier's steps (rank 0's view), the same on every rank."""

    holdings: list[Holding | None]
    durable: list[int]

    def on_nodes(self, step: int) -> tuple[list[str], list[str]]:
        """The step's files (as its manifest names them) and those that no node holds."""
        required = next((h[step][0] for h in self.holdings if h and step in h), [])
        held = {n for h in self.holdings if h and step in h for n in h[step][1]}
        return required, [n for n in required if n not in held]

    def explain(self, step: int | None) -> str:
        """Why ``step`` (None: any step) is not restorable though some node holds part of it,
        and which tier to configure; empty when no node holds any of it."""
        found = sorted({s for h in self.holdings if h for s in h if step in (None, s) and s not in self.durable})
        parts = [f"step {s}: {self.on_nodes(s)[1]}" for s in found if self.on_nodes(s)[1]]
        if not parts:
            return ""
        return (f"; incomplete on every tier, files on no node and in no durable tier ({'; '.join(parts)}). "
                "To restore after losing a node's directory, save with replicas=2 (a copy on another node) "
                "or durable=PATH (a directory every rank sees)")

    def steps(self) -> list[int]:
        """Every step restorable from some tier, ascending."""
        found = {s for h in self.holdings if h for s in h}
        return sorted({s for s in found if not self.on_nodes(s)[1]} | set(self.durable))


class Tiers:
    """The tiers of one rank's manager: its node's ``directory`` (with the replicas it keeps)
    and the optional ``durable`` path. The caller's thread only."""

    def __init__(self, group: RankGroup, layout: Layout, directory: str, durable: str | None,
                 replicas: int = 1, *, drives: StepDrives | None = None) -> None:
        self.group, self.layout, self.directory, self.durable = group, layout, directory, durable
        self.replicas = replicas
        self.folders = NodeFolders(directory, drives)  # on a volume: this node's files on its drives
        self._where: dict[int, dict[str, str]] = {}  # on a leader: step -> file name -> path here

    def survey(self) -> Survey:
        """Collective: what each tier holds (see the module)."""
        mine = self._holdings() if self.layout.leader else None
        lasting = list_steps(self.durable) if self.durable is not None and self.group.rank == 0 else []
        views = self.group.gather((mine, lasting), thread="main", what="listing the tiers")
        return Survey(holdings=[v[0] for v in views], durable=views[0][1])

    def _holdings(self) -> Holding:
        """This node's steps and replicas: each step's required files, the ones here, and
        whether its own ``step-N`` holds them all; remembers where each file is."""
        out: Holding = {}
        self._where = {}
        folders = [(self.directory, True)]
        root = os.path.join(self.directory, REPLICAS)
        if os.path.isdir(root):
            folders += [(os.path.join(root, n), False) for n in sorted(os.listdir(root))]
        for folder, own in folders:
            for step in list_steps(folder):
                path = step_dir(folder, step)
                try:
                    manifest = read_manifest(path, step)
                    found = self.folders.files(path)
                    names = list(found)
                except (OSError, CheckpointCorruptError) as exc:
                    log.warning("deepnvme.CheckpointManager: ignoring %s: %s", path, exc)
                    continue
                required = sorted([*manifest.get("files", {manifest.get("file", ""): 0}), MANIFEST])
                where = self._where.setdefault(step, {})
                _, sizes, whole, mine = out.get(step, (required, {}, False, []))
                for name in names:
                    where.setdefault(name, found[name])
                    sizes.setdefault(name, os.path.getsize(found[name]))
                out[step] = (required, sizes, whole or (own and set(required) <= set(names)),
                             sorted(names) if own else mine)
        return out

    def sources(self, survey: Survey, step: int, reads: Reads | None = None) -> Iterator[Source]:
        """Collective, lazily: where to read ``step`` (:meth:`prepare`), then, if that copy turns
        out corrupt and the durable tier holds the step too, the durable copy (logged)."""
        first = self.prepare(survey, step, reads)
        yield first
        lasting = None if self.durable is None else step_dir(self.durable, step)
        if lasting is not None and step in survey.durable and first.path != lasting:
            log.warning("deepnvme.CheckpointManager.restore: step %d is corrupt on the nodes; trying its "
                        "durable copy %r", step, lasting)
            yield Source(lasting, _nothing)

    def prepare(self, survey: Survey, step: int, reads: Reads | None = None) -> Source:
        """Collective: the directory this rank reads ``step`` from, and what to call once read.
        Raises (on every rank) when no tier holds every file of the step, saying which tier to
        configure, and when gathering the files fails on some rank. ``reads``: the byte ranges
        each rank will read (:func:`~._dcp_restore.plan_reads`), so that only those travel."""
        required, missing = survey.on_nodes(step)
        here = [h for h in survey.holdings if h is not None]
        if not missing and all(step in h and h[step][2] for h in here):
            return Source(step_dir(self.directory, step), _nothing)
        if missing or not required:
            if step in survey.durable and self.durable is not None:
                log.info("deepnvme.CheckpointManager: restoring step %d from the durable tier %r", step, self.durable)
                return Source(step_dir(self.durable, step), _nothing)
            raise FileNotFoundIOError(f"checkpoint step {step} in {self.directory!r}{survey.explain(step)}",
                                      path=self.directory, offset=None, size=None, errno=2)
        lost = [i for i, h in enumerate(survey.holdings) if h is not None and step not in h]
        log.info("deepnvme.CheckpointManager: restoring step %d from the %s tier", step,
                 "replica" if lost else "local")
        return self._gather(survey, step, required, reads)

    def _describe_step(self, survey: Survey, step: int) -> tuple[dict[str, Any] | None, Metadata | None]:
        """Collective: the step's manifest and DCP metadata, read by the first node holding
        them and sent to every rank (None, None where it could not read them)."""
        g = self.group
        holder = next(r for r in self.layout.leaders if step in (survey.holdings[r] or {}))
        payload: list[Any] = [None]
        if g.rank == holder:
            try:
                where = self._where[step]
                with open(where[MANIFEST], "rb") as f:
                    manifest = json.load(f)
                with open(where[".metadata"], "rb") as f:
                    payload[0] = (manifest, f.read())
            except (OSError, KeyError, ValueError) as exc:
                log.warning("deepnvme.CheckpointManager: could not read the manifest or .metadata of step %d "
                            "(%s): the nodes exchange whole files", step, exc)
        dist.broadcast_object_list(payload, src=g.ranks[holder], group=g.group("main"))
        if payload[0] is None:
            return None, None
        manifest, raw = payload[0]
        try:
            metadata = pickle.loads(raw)
        except Exception as exc:  # noqa: BLE001 (the read itself reports a bad .metadata)
            log.warning("deepnvme.CheckpointManager: .metadata of step %d does not unpickle (%s)", step, exc)
            return manifest, None
        return manifest, metadata if isinstance(metadata, Metadata) else None

    def _plan(self, survey: Survey, step: int, required: list[str], reads: Reads | None) -> _Plan:
        """Collective: what each node lacking some of ``step``'s files gets, and from where: the
        byte ranges its ranks will read (at the saving world size, when every rank could plan its
        load), whole files otherwise; whole files of its own ranks and of the ranks it keeps
        replicas of when its own copy of the step is lost (it heals)."""
        g, layout = self.group, self.layout
        manifest, metadata = self._describe_step(survey, step)
        ranks_files: list[list[str]] = [] if manifest is None else [r["files"] for r in manifest.get("ranks", [])]
        local: dict[str, frozenset[int]] = {}
        for leader in layout.leaders:
            node = layout.nodes[layout.node_of(leader)]
            for name in (survey.holdings[leader] or {}).get(step, ([], {}, False, []))[1]:
                local[name] = local.get(name, frozenset()) | frozenset(node)
        per_rank = None
        if reads is not None and metadata is not None and manifest is not None and \
                int(manifest.get("world_size", 0)) == g.world:
            per_rank = reads(metadata, local)  # collective: every rank calls it here
        plan = _Plan(local=local, moves={}, ranges={}, heal={})
        for dst in layout.leaders:
            held = (survey.holdings[dst] or {}).get(step)
            if held is not None and held[2]:
                continue
            node = layout.nodes[layout.node_of(dst)]
            have = held[1] if held is not None else {}
            own_dir = set(held[3]) if held is not None else set()
            ours = {n for r in node if r < len(ranks_files) for n in ranks_files[r]}
            whole: set[str] = set()
            if ranks_files and not ours <= own_dir:  # this node's copy of the step is lost: heal it
                sources = sorted({(r - layout.local_world) % g.world for r in node}) if self.replicas == 2 else []
                plan.heal[dst] = (sorted(ours), {s: ranks_files[s] for s in sources if s < len(ranks_files)})
                whole = ours | {n for files in plan.heal[dst][1].values() for n in files}
            wanted: dict[str, Ranges] = {}
            if per_rank is not None:
                for r in node:
                    for name, offset, length in per_rank[r]:
                        wanted.setdefault(name, []).append((offset, length))
            for name in required:
                if name in have:
                    continue
                src = next(r for r in layout.leaders if name in (survey.holdings[r] or {}).get(step, ([], {}))[1])
                size = (survey.holdings[src] or {})[step][1][name]
                partial = per_rank is not None and name not in whole and name not in (MANIFEST, ".metadata")
                spans = _merged(wanted.get(name, [])) if partial else None
                plan.ranges.setdefault(dst, {})[name] = (size, spans)
                if spans is None or spans:
                    plan.moves.setdefault((src, dst), []).append((name, size, spans))
        return plan

    def _gather(self, survey: Survey, step: int, required: list[str], reads: Reads | None) -> Source:
        """Collective: every node that lacks some of ``step``'s files in its own directory gets
        them into a hidden directory (see the module); a node whose copy was lost rebuilds it
        (and the replicas it kept) once the step is read."""
        g, layout = self.group, self.layout
        plan = self._plan(survey, step, required, reads)
        own: BaseException | None = None
        building: str | None = None
        held = (survey.holdings[g.rank] or {}).get(step) if layout.leader else None
        whole = held is not None and held[2]
        mine = plan.ranges.get(g.rank, {})
        at: dict[str, str] = {}  # file -> its path in the gathering folder (on its drive)
        if layout.leader and not whole:
            try:
                building, at = self._gathering(step, mine)
            except BaseException as exc:  # the transfers below still run, so no rank waits for this one
                own = exc
        got = 0
        for (src, dst), files in sorted(plan.moves.items()):
            listed = [(n, size) for n, size, _ in files]
            spans = [sp for _, _, sp in files]
            if g.rank == src:
                out = Transfer(g.ranks[dst], [(self._where[step][n], size) for n, size in listed], spans)
                own = exchange(g.group("main"), send=out, receive=None) or own
            elif g.rank == dst:
                into = Transfer(g.ranks[src], [(at.get(n, os.devnull), s) for n, s in listed], spans)
                got += into.nbytes
                own = exchange(g.group("main"), send=None, receive=into) or own
        if layout.leader and not whole:
            log.info("deepnvme.CheckpointManager: step %d: this node received %d bytes of %d files from the "
                     "other nodes", step, got, sum(1 for _, sp in mine.values() if sp is None or sp))
        path = building if building is not None else step_dir(self.directory, step)
        views = g.gather((path if layout.leader else None, describe(own)), thread="main",
                         what=f"restore(step={step}) files")
        leader = layout.nodes[layout.node][0]
        chosen: Any = views[leader][0]
        present = {n: sp for n, (_, sp) in plan.ranges.get(leader, {}).items() if sp is not None}
        heal = plan.heal.get(g.rank) if building is not None else None

        def done(restored: bool) -> None:
            if building is None:
                return
            try:
                if restored and heal is not None:
                    self._heal(at, step, *heal)
            finally:
                self.folders.discard(building)

        if any(v[1] for v in views):
            done(False)
            raise failed(f"gathering the files of checkpoint step {step} from the other nodes",
                         [v[1] for v in views], own)
        return Source(str(chosen), done, ReadHints(local=plan.local, present=present))

    def _gathering(self, step: int, lacking: dict[str, tuple[int, Ranges | None]]) -> tuple[str, dict[str, str]]:
        """A node's hidden folder to read ``step`` from: hard links to the step's files this
        node holds (each on its drive), and a place for each file it ``lacks`` (file -> (size,
        ranges)), on the drive :meth:`NodeFolders.place` gives it; a file read in no range here
        is a sparse placeholder. Returns the folder (drive 0's) and each file's path in it."""
        building = self.folders.building(self.directory, step)
        try:
            drive = {n: self.folders.drive_of(p) for n, p in self._where.get(step, {}).items() if n != PLACEMENT_NAME}
            at = {n: self.folders.slot(building, n, d) for n, d in drive.items()}
            for name, path in at.items():
                link_or_copy(self._where[step][name], path)
            drive |= self.folders.place({n: size for n, (size, _) in lacking.items()},
                                        used=self.folders.fill({n: p for n, p in at.items() if n not in SHARED}))
            for name, (size, kept) in lacking.items():
                at[name] = self.folders.slot(building, name, drive[name])
                if kept is not None and not kept:  # read in no range here: a sparse file
                    with open(at[name], "wb") as placeholder:
                        placeholder.truncate(size)
            self.folders.seal(building, drive)
        except BaseException:
            self.folders.discard(building)
            raise
        return building, at

    def _heal(self, gathered: dict[str, str], step: int, ours: list[str], sources: dict[int, list[str]]) -> None:
        """This node's copy of ``step`` was lost and the step was restored from the others:
        publish it again from the ``gathered`` files (file -> path: its ranks' files,
        ``.metadata`` and the manifest), and the replicas it kept of ``sources`` (rank -> files),
        each built under a hidden name (each file on the drive it was gathered on) and renamed
        into place, so that losing another node is survivable. Failures are logged (the restore
        itself succeeded)."""
        targets = [(self.directory, ours)] if not os.path.isdir(step_dir(self.directory, step)) else []
        targets += [(replica_dir(self.directory, s), files) for s, files in sources.items()
                    if not os.path.isdir(step_dir(replica_dir(self.directory, s), step))]
        for folder, files in targets:
            building: str | None = None
            try:
                building = self.folders.building(folder, step)
                drive = {n: self.folders.drive_of(gathered[n]) for n in [*files, *SHARED]}
                for name, d in drive.items():
                    link_or_copy(gathered[name], self.folders.slot(building, name, d))
                self.folders.seal(building, drive, step_dir(folder, step))
                self.folders.publish(building, folder, step)
                log.info("deepnvme.CheckpointManager: rebuilt step %d in %r from the other nodes", step, folder)
            except (OSError, KeyError) as exc:
                log.error("deepnvme.CheckpointManager: could not rebuild step %d in %r after restoring it "
                          "from the other nodes: %s", step, folder, exc)
                if building is not None:
                    self.folders.discard(building, folder, step)


@dataclass
class _Plan:
    """What a restore gathers: ``local`` (data file -> ranks whose node holds it), ``moves``
    ((source leader, destination leader) -> (file, size, ranges or None for whole)), ``ranges``
    (destination leader -> file -> (size, ranges or None)) and ``heal`` (destination leader ->
    (its ranks' files, {source rank: files of the replicas it keeps}))."""

    local: dict[str, frozenset[int]]
    moves: dict[tuple[int, int], list[tuple[str, int, Ranges | None]]]
    ranges: dict[int, dict[str, tuple[int, Ranges | None]]]
    heal: dict[int, tuple[list[str], dict[int, list[str]]]]


@dataclass(frozen=True)
class Source:
    """Where a rank reads a step: ``path``, ``done(restored)`` to call once read (True: it was
    restored from there) and, where the nodes gathered its files, the reader's ``hints``."""

    path: str
    done: Callable[[bool], None]
    hints: ReadHints | None = None


def _merged(spans: Ranges) -> Ranges:
    """``spans`` sorted, with overlapping and touching ranges merged."""
    out: Ranges = []
    for offset, length in sorted(spans):
        if out and offset <= out[-1][0] + out[-1][1]:
            last = out[-1]
            out[-1] = (last[0], max(last[0] + last[1], offset + length) - last[0])
        else:
            out.append((offset, length))
    return out


def _nothing(restored: bool = False) -> None:
    return None
