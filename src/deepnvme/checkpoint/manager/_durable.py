"""The durable tier: committed steps copied in the background to ``durable=PATH``, a filesystem
every rank sees (NFS, Lustre), so that they outlive the nodes.

Every ``durable_every``-th committed step is offered to the :class:`Drainer` (the writer thread,
right after the commit); its own thread copies it while training goes on, so ``save()`` never
waits for it. Each rank copies its own files of the step from its node's directory into a
hidden building directory in ``PATH`` (rank 0 creates it and adds ``.metadata``); the ranks
agree that all copies are written and fsynced; rank 0 adds the manifest last, publishes
``PATH/step-N`` in one rename and applies ``keep_durable`` retention. A multi-rank step there is
a complete ``torch.distributed.checkpoint`` checkpoint (every rank's files in one directory), so
it restores at any world size and stock ``torch.distributed.checkpoint.load`` reads it.

Until its copy, an offered step's files are pinned (hard links in a hidden directory), so that
local retention may remove the step meanwhile. When draining falls behind (a step is offered
while another waits), the waiting step is dropped and logged, never queued: the drainer copies
the newest step every rank has offered. The ranks pick that step together on the manager's
third gloo group. ``close()`` copies the last offered step, then raises the first failure
(failures are also logged as they happen).

A manager on a volume (:mod:`._drives`) pins each drive's files of the step in a hidden folder
of that drive (hard links stay on their filesystem) and copies them from there; the durable copy
is a plain step directory, so its manifest loses the ``drive`` entries and, for a step of
several ranks, the placement record (``.metadata`` names files by name only: a plain DCP folder).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from typing import Any

from ...io import durable
from .._placed import PLACEMENT_NAME
from ._drives import StepDrives
from ._group import RankGroup
from ._lock import DirectoryLock, try_lock
from ._policy import retention_victims
from ._steps import (
    MANIFEST,
    building_path,
    delete_step,
    list_steps,
    new_building,
    read_manifest,
    remove_leftovers,
    step_dir,
)
from ._transfer import link_or_copy
from ._votes import describe, failed

__all__ = ["Drainer", "copy_file"]

log = logging.getLogger(__name__)


def copy_file(src: str, dst: str) -> None:
    """Copy one committed file into the durable tier and fsync it."""
    shutil.copyfile(src, dst)
    durable.fsync_path(dst)


class Drainer:
    """Copies offered steps of ``source`` (this node's directory) to ``path`` on its own thread
    (see the module). ``group``: the manager's ranks (None: one process). :meth:`offer` from the
    writer thread, :meth:`close` from the caller's; holds ``path``'s writer lock on rank 0."""

    def __init__(self, path: str, *, source: str, every: int, keep: int | None,
                 group: RankGroup | None, drives: StepDrives | None = None) -> None:
        self.path, self.source, self.every, self.keep, self.group = path, source, every, keep, group
        self.drives = drives  # one process on a volume: ``source`` is drive 0's folder
        self._cond = threading.Condition()
        self._offered: list[int] = []
        self._pins: dict[int, str] = {}  # offered step -> its pinned files (see offer)
        self._count = 0
        self._copied: int | None = None
        self._stopping = False
        self._lock: DirectoryLock | None = None
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="deepnvme-checkpoint-durable", daemon=True)
        self._thread.start()

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank

    def offer(self, step: int) -> None:
        """A step just committed on every rank: copy it if it is a ``durable_every``-th one. Its
        files get second names in a hidden directory (a pin), so that local retention cannot
        take them away before the copy; a pin left by a killed process goes with the leftovers."""
        self._count += 1
        if self._count % self.every:
            return
        pin = building_path(self.source, step)
        try:
            local = step_dir(self.source, step)
            for here, there in zip(self._across(pin), self._across(local)):
                if here == pin or os.path.isdir(there):
                    os.mkdir(here)
                    for name in os.listdir(there):
                        link_or_copy(os.path.join(there, name), os.path.join(here, name))
        except OSError as exc:  # the copy reports it (collectively)
            log.error("deepnvme.CheckpointManager: could not pin step %d for its durable copy: %s", step, exc)
        with self._cond:
            self._offered.append(step)
            self._pins[step] = pin
            self._cond.notify()

    def _unpin(self, upto: int) -> None:
        with self._cond:
            done = [s for s in self._pins if s <= upto]
            paths = [self._pins.pop(s) for s in done]
        for path in paths:
            for here in self._across(path):
                shutil.rmtree(here, ignore_errors=True)

    def _across(self, path: str) -> tuple[str, ...]:
        """The folder ``path`` of drive 0's folder on every drive (itself without a volume)."""
        return (path,) if self.drives is None else self.drives.across(path)

    def close(self) -> None:
        """Copy the last offered step if it is not copied yet, end the thread and release the
        lock; raise the first failure (collective over the ranks)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join()
        if self._lock is not None:
            self._lock.release()
        if self.errors:
            raise self.errors[0]

    # ---- the drain thread -------------------------------------------------------------------

    def _fresh(self) -> bool:
        return bool(self._offered) and (self._copied is None or self._offered[-1] > self._copied)

    def _run(self) -> None:
        try:
            self._drain()
        except BaseException as exc:  # a rank that stopped answering: nothing more is copied
            log.error("deepnvme.CheckpointManager: the durable copy stopped: %s", exc)
            self.errors.append(exc)

    def _drain(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._fresh() or self._stopping)
                latest, stopping = (self._offered[-1] if self._offered else None), self._stopping
            views = [(latest, stopping)] if self.group is None else self.group.gather(
                (latest, stopping), thread="durable", what="durable copy")
            offered: list[int | None] = [v[0] for v in views]
            chosen = None if None in offered else min(v for v in offered if v is not None)
            if chosen is not None and (self._copied is None or chosen > self._copied):
                with self._cond:
                    skipped = [s for s in self._offered if s < chosen and (self._copied is None or s > self._copied)]
                    self._offered = [s for s in self._offered if s >= chosen]
                if skipped:
                    log.warning("deepnvme.CheckpointManager: durable copy fell behind; steps %s are not "
                                "copied to %r, step %d is", skipped, self.path, chosen)
                try:
                    self._copy(chosen)
                except BaseException as exc:  # reported by close(); logged now
                    log.error("deepnvme.CheckpointManager: %s", exc)
                    self.errors.append(exc)
                self._copied = chosen
                self._unpin(chosen)
            elif all(v[1] for v in views):
                self._unpin(max(self._pins, default=-1))
                return

    def _gather(self, obj: Any, what: str) -> list[Any]:
        return [obj] if self.group is None else self.group.gather(obj, thread="durable", what=what)

    def _copy(self, step: int) -> None:
        """Copy ``step`` into the durable tier, committed as the module says."""
        with self._cond:
            local = self._pins.get(step, step_dir(self.source, step))
        own: BaseException | None = None
        building: str | None = None
        if self.rank == 0:
            try:
                if self._lock is None:
                    self._lock = try_lock(self.path)
                    remove_leftovers(self.path)
                building = new_building(self.path, step)
            except BaseException as exc:
                own = exc
        building, made = self._gather((building, describe(own)), f"durable copy of step {step}")[0]
        if building is None:
            raise failed(f"copying checkpoint step {step} to durable={self.path!r}", [made], own)
        try:
            found = self._found(local)
            for name in self._names(local, step):
                copy_file(found.get(name, os.path.join(local, name)), os.path.join(building, name))
        except BaseException as exc:
            own = exc
        votes = self._gather(describe(own), f"durable copy of step {step}")
        if self.rank == 0:
            if not any(votes):
                try:
                    if self.drives is None:
                        copy_file(os.path.join(local, MANIFEST), os.path.join(building, MANIFEST))
                    else:  # a plain directory there: every file lies beside the manifest
                        manifest = read_manifest(local, step)
                        manifest.pop("drive", None)
                        manifest.pop("drives", None)
                        for key in ("files", "file_checksums"):  # several ranks: no placement record
                            manifest.get(key, {}).pop(PLACEMENT_NAME, None)
                        with open(os.path.join(building, MANIFEST), "w", encoding="utf-8") as f:
                            json.dump(manifest, f, indent=1)  # publish_dir fsyncs it
                    durable.publish_dir(building, step_dir(self.path, step))
                except BaseException as exc:
                    own = exc
            if own is not None or any(votes):
                shutil.rmtree(building, ignore_errors=True)
        outcome = self._gather(describe(own), f"durable commit of step {step}")
        if any(votes) or outcome[0] is not None:
            raise failed(f"copying checkpoint step {step} to durable={self.path!r} (the step stays in "
                         "the local tier)", [v or (outcome[0] if r == 0 else None) for r, v in enumerate(votes)],
                         own)
        log.info("deepnvme.CheckpointManager: step %d copied to %r", step, self.path)
        if self.rank == 0:
            self._retire()

    def _found(self, local: str) -> dict[str, str]:
        """Each file of the step (or pin) folder ``local`` by name, on whichever drive it lies."""
        return {n: os.path.join(here, n) for here in self._across(local)[::-1] if os.path.isdir(here)
                for n in os.listdir(here)}

    def _names(self, local: str, step: int) -> list[str]:
        """This rank's files of ``step`` (rank 0's include ``.metadata``; never the manifest)."""
        manifest = read_manifest(local, step)
        if "ranks" not in manifest:  # one process: its files
            return sorted(n for n in self._found(local) if n != MANIFEST)
        return [*manifest["ranks"][self.rank]["files"], *([".metadata"] if self.rank == 0 else [])]

    def _retire(self) -> None:
        for old in retention_victims(list_steps(self.path), self.keep):
            try:
                delete_step(self.path, old)
            except OSError as exc:
                log.error("deepnvme.CheckpointManager: could not remove step %d from durable=%r "
                          "(keep_durable=%s): %s", old, self.path, self.keep, exc)
                return
