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
is needed; DCP then reads that directory. Only where the nodes together lack some file does the
durable tier serve the step (all ranks read it there; any world size).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ...errors import CheckpointCorruptError, FileNotFoundIOError
from ._group import RankGroup
from ._nodes import Layout
from ._replicas import REPLICAS
from ._steps import MANIFEST, list_steps, new_building, read_manifest, step_dir
from ._transfer import Transfer, exchange, link_or_copy
from ._votes import describe, failed

__all__ = ["Survey", "Tiers"]

log = logging.getLogger(__name__)

Holding = dict[int, tuple[list[str], dict[str, int], bool]]  # step -> (required, present sizes, own dir whole)


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

    def __init__(self, group: RankGroup, layout: Layout, directory: str, durable: str | None) -> None:
        self.group, self.layout, self.directory, self.durable = group, layout, directory, durable
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
                    names = os.listdir(path)
                except (OSError, CheckpointCorruptError) as exc:
                    log.warning("deepnvme.CheckpointManager: ignoring %s: %s", path, exc)
                    continue
                required = sorted([*manifest.get("files", {manifest.get("file", ""): 0}), MANIFEST])
                where = self._where.setdefault(step, {})
                _, sizes, whole = out.get(step, (required, {}, False))
                for name in names:
                    where.setdefault(name, os.path.join(path, name))
                    sizes.setdefault(name, os.path.getsize(os.path.join(path, name)))
                out[step] = (required, sizes, whole or (own and set(required) <= set(names)))
        return out

    def sources(self, survey: Survey, step: int) -> Iterator[tuple[str, Callable[[], None]]]:
        """Collective, lazily: where to read ``step`` (:meth:`prepare`), then, if that copy turns
        out corrupt and the durable tier holds the step too, the durable copy (logged)."""
        path, done = self.prepare(survey, step)
        yield path, done
        lasting = None if self.durable is None else step_dir(self.durable, step)
        if lasting is not None and step in survey.durable and path != lasting:
            log.warning("deepnvme.CheckpointManager.restore: step %d is corrupt on the nodes; trying its "
                        "durable copy %r", step, lasting)
            yield lasting, _nothing

    def prepare(self, survey: Survey, step: int) -> tuple[str, Callable[[], None]]:
        """Collective: the directory this rank reads ``step`` from, and what to call once read.
        Raises (on every rank) when no tier holds every file of the step, saying which tier to
        configure, and when gathering the files fails on some rank."""
        required, missing = survey.on_nodes(step)
        here = [h for h in survey.holdings if h is not None]
        if not missing and all(step in h and h[step][2] for h in here):
            return step_dir(self.directory, step), _nothing
        if missing or not required:
            if step in survey.durable and self.durable is not None:
                log.info("deepnvme.CheckpointManager: restoring step %d from the durable tier %r", step, self.durable)
                return step_dir(self.durable, step), _nothing
            raise FileNotFoundIOError(f"checkpoint step {step} in {self.directory!r}{survey.explain(step)}",
                                      path=self.directory, offset=None, size=None, errno=2)
        lost = [i for i, h in enumerate(survey.holdings) if h is not None and step not in h]
        log.info("deepnvme.CheckpointManager: restoring step %d from the %s tier", step,
                 "replica" if lost else "local")
        return self._gather(survey, step, required)

    def _gather(self, survey: Survey, step: int, required: list[str]) -> tuple[str, Callable[[], None]]:
        """Collective: every node that lacks some of ``step``'s files in its own directory gets
        them into a hidden directory (see the module)."""
        g, layout = self.group, self.layout
        moves: dict[tuple[int, int], list[tuple[str, int]]] = {}
        building: str | None = None
        for dst in layout.leaders:
            held = survey.holdings[dst] or {}
            if step in held and held[step][2]:
                continue
            have = held[step][1] if step in held else {}
            for name in required:
                if name not in have:
                    src = next(r for r in layout.leaders if step in (survey.holdings[r] or {})
                               and name in (survey.holdings[r] or {})[step][1])
                    moves.setdefault((src, dst), []).append((name, (survey.holdings[src] or {})[step][1][name]))
        own: BaseException | None = None
        whole = layout.leader and step in (survey.holdings[g.rank] or {}) and (survey.holdings[g.rank] or {})[step][2]
        if layout.leader and not whole:
            try:
                os.makedirs(self.directory, exist_ok=True)
                building = new_building(self.directory, step)
                for name, path in self._where.get(step, {}).items():
                    link_or_copy(path, os.path.join(building, name))
            except BaseException as exc:  # the transfers below still run, so no rank waits for this one
                own = exc
        for (src, dst), files in sorted(moves.items()):
            if g.rank == src:
                out = [(self._where[step][n], size) for n, size in files]
                own = exchange(g.group("main"), send=Transfer(g.ranks[dst], out), receive=None) or own
            elif g.rank == dst:
                into = [(os.devnull if building is None else os.path.join(building, n), s) for n, s in files]
                own = exchange(g.group("main"), send=None, receive=Transfer(g.ranks[src], into)) or own
        path = building if building is not None else step_dir(self.directory, step)
        views = g.gather((path if layout.leader else None, describe(own)), thread="main",
                         what=f"restore(step={step}) files")
        mine: Any = views[layout.nodes[layout.node][0]][0]

        def done() -> None:
            if building is not None:
                shutil.rmtree(building, ignore_errors=True)

        if any(v[1] for v in views):
            done()
            raise failed(f"gathering the files of checkpoint step {step} from the other nodes",
                         [v[1] for v in views], own)
        return str(mine), done


def _nothing() -> None:
    return None
