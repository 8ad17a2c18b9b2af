"""A single-process :class:`~deepnvme.CheckpointManager` on a volume: each step's file whole on one drive.

::

    DRIVE0/ckpts/.deepnvme-writer.lock, step-N/manifest.json      the step tree (drive 0's folder)
    DRIVEd/ckpts/step-N/state.pt                                   the step's file, on its drive d
    DRIVEd/ckpts/.deepnvme-volume.part<d> + .volume.json           the volume's layout marker

``state.pt`` stays a plain torch.save file that ``torch.load`` reads where it lies. Its drive is
the one holding the fewest bytes of the steps that stay after retention (the newest ``keep - 1``
committed steps and those in flight), ties to the drive written least recently, so equal saves
alternate drives. The manifest names the drive (``"drive"``) and the drive folders
(``"drives"``). The marker is a zero-byte striped file of :mod:`deepnvme.io.volume_files`: its
records name the drives in order and the stripe unit, so reopening with other drives, another
order or stripe, or a drive not mounted raises :class:`~deepnvme.VolumeLayoutError`.

A step saved by several ranks (one node) is a DCP checkpoint whose data files
:mod:`._dcp_step` places on the drives (:func:`..dcp._volume.place_plans`), with ``.metadata``,
the placement record and the manifest in drive 0's ``step-N``; the same folders and order hold.

Commit order: the file's step folder on drive ``d`` is published first, drive 0's (with the
manifest) last, which is what lists the step; retention unlists on drive 0 first. A crash in
between leaves a ``step-N`` folder on drive ``d`` that drive 0 does not hold: a leftover that
the next writer removes with the hidden building and deleting folders of every drive.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable

from ...errors import CheckpointCorruptError, VolumeLayoutError
from ...io import durable
from ...io.volume import Volume, VolumePath
from ...io.volume_files import Layouts
from .._placed import assign, drive_folders
from ._group import RankGroup
from ._lock import DirectoryLock, try_lock
from ._steps import (
    FILE,
    delete_step,
    find_leftovers,
    find_step_dirs,
    new_building,
    read_manifest,
    remove_leftovers,
    step_dir,
)

__all__ = ["MARKER", "StepDrives", "open_drives", "same_volume", "take_directory"]

log = logging.getLogger(__name__)

MARKER = ".deepnvme-volume"  # the zero-byte striped file whose records name the volume's layout


class StepDrives:
    """The drive folders of a manager directory on a volume, and where each step's file lies.
    ``choose``/``placed``/``forget`` are thread-safe (the caller's and the writer's thread)."""

    def __init__(self, target: Volume | VolumePath) -> None:
        folders = drive_folders(target)
        if folders is None:
            raise TypeError(f"not a volume folder: {target!r}")
        #: the manager directory on each drive, in the volume's order; drive 0's holds the steps
        self.folders: tuple[str, ...] = folders
        self.target = target
        self.marker = target / MARKER
        self._lock = threading.Lock()
        self._known: dict[int, tuple[int, int]] = {}  # step -> (drive, bytes), committed or in flight

    @property
    def home(self) -> str:
        return self.folders[0]

    def check(self) -> None:
        """Refuse a volume opened with other drives, another order or stripe, or a drive folder
        missing, once a writer marked it (:class:`VolumeLayoutError`); creates nothing."""
        if any(os.path.exists(self.marker.record(d)) for d in range(len(self.folders))):
            self._checked(lambda: Layouts().current(self.marker))

    def claim(self) -> None:
        """The writer, at its first save: create every drive folder and the marker, or check it."""
        self._checked(lambda: Layouts().ensure(self.marker, 0))
        self._checked(lambda: Layouts().current(self.marker))

    def _checked(self, call: Callable[[], object]) -> None:
        """``call()``; a layout mismatch is re-raised saying it concerns this manager's steps."""
        try:
            call()
        except VolumeLayoutError as exc:
            err = VolumeLayoutError(f"CheckpointManager on volume folders {list(self.folders)}: open it "
                                    f"with the drives (in order) and stripe it was written with: {exc.strerror or exc}",
                                    path=None, errno=exc.errno)  # the message names exc's file already
            err.path = exc.path
            raise err from exc

    def choose(self, step: int, committed: list[int], keep: int | None) -> int:
        """The drive of ``step``'s file (see the module) and count it in flight, sized as the
        newest step known until :meth:`placed` gives its size."""
        with self._lock:
            known = sorted(set(committed) | set(self._known))
            stays = known if keep is None else known[max(0, len(known) - keep + 1):] if keep > 1 else []
            where = {s: self._where(s) for s in known}
            fill, last = [0] * len(self.folders), [-1] * len(self.folders)
            for s in stays:
                fill[where[s][0]] += where[s][1]
            for s in known:
                last[where[s][0]] = s
            order = sorted(range(len(self.folders)), key=lambda d: (last[d], d))  # least recent first
            drive = order[assign({FILE: 1}, len(order), used=[fill[d] for d in order])[FILE]]
            self._known[step] = (drive, where[known[-1]][1] if known else 0)
            return drive

    def _where(self, step: int) -> tuple[int, int]:
        if step not in self._known:
            try:
                manifest = read_manifest(step_dir(self.home, step), step)
                self._known[step] = (int(manifest.get("drive", 0)), int(manifest["file_size"]))
            except (CheckpointCorruptError, KeyError, TypeError, ValueError):
                return (0, 0)  # a damaged step holds no place here; restore reports it
        return self._known[step]

    def placed(self, step: int, drive: int, nbytes: int) -> None:
        """``step`` lies on ``drive`` with ``nbytes`` (staged: its tensors; committed: its file)."""
        with self._lock:
            self._known[step] = (drive, nbytes)

    def forget(self, step: int) -> None:
        """``step`` failed or was removed."""
        with self._lock:
            self._known.pop(step, None)

    def begin(self, step: int, drive: int) -> tuple[str, str | None]:
        """Hidden building folders for ``step``: the file's on ``drive``, and drive 0's for the
        manifest when the file lies on another drive (else None)."""
        building = new_building(self.folders[drive], step)
        if drive == 0:
            return building, None
        try:
            return building, new_building(self.home, step)
        except BaseException:
            shutil.rmtree(building, ignore_errors=True)
            raise

    def at(self, path: str) -> VolumePath:
        """The folder named as ``path`` (a step or building folder in drive 0's folder) on every
        drive: what :class:`~deepnvme.checkpoint.dcp.NVMeStorageWriter`/``Reader`` take."""
        return self.target / os.path.basename(os.path.normpath(path))

    def holds(self, path: str) -> bool:
        """Whether ``path`` is a folder in drive 0's manager folder (a step, building or pin folder,
        its files on every drive), not a plain folder elsewhere (a durable copy)."""
        return os.path.dirname(os.path.normpath(path)) == os.path.normpath(self.home)

    def beside(self, path: str) -> tuple[str, ...] | None:
        """:meth:`across` for a folder this volume :meth:`holds`, else None (a plain folder)."""
        return self.across(path) if self.holds(path) else None

    def across(self, path: str) -> tuple[str, ...]:
        """The folder named as ``path`` in every drive's folder, drive 0's first."""
        return tuple(os.path.join(folder, os.path.basename(os.path.normpath(path))) for folder in self.folders)

    def publish(self, building: str, step: int) -> None:
        """Publish the step built in the folders named ``building``: each other drive's (where
        it has files) first, drive 0's last, which lists the step (:func:`durable.publish_dir`)."""
        for folder, here in zip(self.folders[1:], self.across(building)[1:]):
            if os.path.isdir(here):
                durable.publish_dir(here, step_dir(folder, step))
        durable.publish_dir(building, step_dir(self.home, step))

    def discard(self, building: str, step: int | None = None) -> None:
        """Remove the folders named ``building`` on every drive (a failed save's) and, when
        drive 0 did not publish ``step``, the step's folders published on the other drives."""
        for here in self.across(building):
            shutil.rmtree(here, ignore_errors=True)
        if step is not None and not os.path.isdir(step_dir(self.home, step)):
            for folder in self.folders[1:]:
                shutil.rmtree(step_dir(folder, step), ignore_errors=True)

    def delete(self, step: int) -> None:
        """Remove committed ``step``: drive 0's folder first (the step is no longer listed),
        then its file's folder on the other drives."""
        delete_step(self.home, step)
        for folder in self.folders[1:]:
            if os.path.isdir(step_dir(folder, step)):
                delete_step(folder, step)
        self.forget(step)

    def leftovers(self) -> list[str]:
        """What killed saves and removals left on every drive: hidden building and deleting
        folders, and ``step-N`` folders of other drives that drive 0 does not hold."""
        listed = {s for s, _ in find_step_dirs(self.home)}
        found = [path for folder in self.folders for path in find_leftovers(folder)]
        for folder in self.folders[1:]:
            found += [path for s, path in find_step_dirs(folder) if s not in listed]
        return found

    def remove_leftovers(self) -> list[str]:
        """Remove :meth:`leftovers` (call only while holding the directory's lock); each
        removal is logged."""
        removed = []
        for path in self.leftovers():
            shutil.rmtree(path)
            log.warning("deepnvme.CheckpointManager: removed %s, left by an interrupted save or removal", path)
            removed.append(path)
        return removed


def open_drives(directory: object, *, replicas: int) -> StepDrives | None:
    """The drive folders of a manager on a volume, its layout checked (None: a plain directory);
    ``ValueError`` for ``replicas=2``, which a volume does not support."""
    if not isinstance(directory, (Volume, VolumePath)):
        return None
    if replicas != 1:
        raise ValueError("CheckpointManager(replicas=2) on a Volume is not supported: replicas need one "
                         "directory per node, on several nodes, and a volume holds one node's steps")
    drives = StepDrives(directory)
    drives.check()
    return drives


def take_directory(directory: str, drives: StepDrives | None) -> DirectoryLock:
    """A writer's first save: the directory's lock, then leftovers of killed saves removed (on a
    volume: the marker made or checked, and leftovers on every drive). A failure releases the
    lock, so the next save tries again."""
    lock = try_lock(directory)
    try:
        if drives is None:
            remove_leftovers(directory)
        else:
            drives.claim()
            drives.remove_leftovers()
    except BaseException:
        lock.release()
        raise
    return lock


def same_volume(group: RankGroup, drives: StepDrives | None) -> None:
    """Collective at construction: ``ValueError`` unless every rank passed the same volume (or
    every rank a plain directory)."""
    volumes = group.gather(None if drives is None else drives.folders, thread="main", what="CheckpointManager()")
    if len(set(volumes)) > 1:
        raise ValueError(f"CheckpointManager: the ranks passed different volumes or directories (drive folders "
                         f"by rank: {volumes}); every rank passes the same Volume")
