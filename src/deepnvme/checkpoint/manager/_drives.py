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

A step saved by several ranks is a DCP checkpoint whose data files :mod:`._dcp_step` places on
the drives (:func:`..dcp._volume.place_plans`), with ``.metadata``, the placement record and the
manifest in drive 0's ``step-N``; the same folders and order hold. Ranks on several nodes each
pass their node's volume: each node places its own ranks' files on its own drives, and keeps the
replicas of another node's files (``.deepnvme-replicas/``, :mod:`._replicas`) across them too:
the folders below drive 0's manager folder exist under the same relative name on every drive.

Commit order: the file's step folder on drive ``d`` is published first, drive 0's (with the
manifest) last, which is what lists the step; retention unlists on drive 0 first. A crash in
between leaves a ``step-N`` folder on drive ``d`` that drive 0 does not hold: a leftover that
the next writer removes with the hidden building and deleting folders of every drive.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
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
from ._votes import describe

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
        return self.target / self._relative(path)

    def _relative(self, path: str) -> str:
        """``path``'s name relative to drive 0's folder (itself: ``"."``; a folder below it),
        else its base name."""
        norm, home = os.path.normpath(path), os.path.normpath(self.home)
        return os.path.relpath(norm, home) if norm == home or norm.startswith(home + os.sep) else os.path.basename(norm)

    def holds(self, path: str) -> bool:
        """Whether ``path`` is a folder in drive 0's manager folder (a step, building or pin folder,
        its files on every drive), not a plain folder elsewhere (a durable copy)."""
        return os.path.dirname(os.path.normpath(path)) == os.path.normpath(self.home)

    def beside(self, path: str) -> tuple[str, ...] | None:
        """:meth:`across` for a folder this volume :meth:`holds`, else None (a plain folder)."""
        return self.across(path) if self.holds(path) else None

    def across(self, path: str) -> tuple[str, ...]:
        """The folder named as ``path`` (in or below drive 0's folder) in every drive's folder,
        drive 0's first."""
        return tuple(os.path.normpath(os.path.join(folder, self._relative(path))) for folder in self.folders)

    def publish(self, building: str, step: int, folder: str | None = None) -> None:
        """Publish the step built in the folders named ``building`` as ``step-N`` of ``folder``
        (drive 0's manager folder or one below it; None: the manager folder): each other drive's
        (where it has files) first, drive 0's last, which lists the step (:func:`durable.publish_dir`)."""
        final = self.across(step_dir(folder or self.home, step))
        for here, there in zip(self.across(building)[1:], final[1:]):
            if os.path.isdir(here):
                if os.path.isdir(there) and not os.path.isdir(final[0]):  # a leftover of a killed publish
                    shutil.rmtree(there)
                durable.publish_dir(here, there)
        durable.publish_dir(building, final[0])

    def discard(self, building: str, step: int | None = None, folder: str | None = None) -> None:
        """Remove the folders named ``building`` on every drive (a failed save's) and, when
        drive 0 did not publish ``step`` (in ``folder``, as for :meth:`publish`), the step's
        folders published on the other drives."""
        for here in self.across(building):
            shutil.rmtree(here, ignore_errors=True)
        final = None if step is None else self.across(step_dir(folder or self.home, step))
        if final is not None and not os.path.isdir(final[0]):
            for there in final[1:]:
                shutil.rmtree(there, ignore_errors=True)

    def delete(self, step: int, folder: str | None = None) -> None:
        """Remove committed ``step`` of ``folder`` (as for :meth:`publish`): drive 0's folder
        first (the step is no longer listed), then its files' folders on the other drives."""
        folders = self.across(folder or self.home)
        delete_step(folders[0], step)
        for here in folders[1:]:
            if os.path.isdir(step_dir(here, step)):
                delete_step(here, step)
        if folder is None:
            self.forget(step)

    def leftovers(self, folder: str | None = None) -> list[str]:
        """What killed saves and removals left in ``folder`` (as for :meth:`publish`) on every
        drive: hidden building and deleting folders, and ``step-N`` folders of other drives that
        drive 0 does not hold."""
        folders = self.across(folder or self.home)
        listed = {s for s, _ in find_step_dirs(folders[0])}
        found = [path for here in folders for path in find_leftovers(here)]
        for here in folders[1:]:
            found += [path for s, path in find_step_dirs(here) if s not in listed]
        return found

    def remove_leftovers(self, folder: str | None = None) -> list[str]:
        """Remove :meth:`leftovers` (call only while holding the directory's lock); each
        removal is logged."""
        removed = []
        for path in self.leftovers(folder):
            shutil.rmtree(path)
            log.warning("deepnvme.CheckpointManager: removed %s, left by an interrupted save or removal", path)
            removed.append(path)
        return removed


def open_drives(directory: object) -> StepDrives | None:
    """The drive folders of a manager on a volume (None: a plain directory); not yet checked
    (:meth:`StepDrives.check`: one process at once, several ranks in :func:`same_volume`)."""
    if not isinstance(directory, (Volume, VolumePath)):
        return None
    return StepDrives(directory)


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


def same_volume(group: RankGroup, drives: StepDrives | None, nodes: tuple[tuple[int, ...], ...]) -> None:
    """Collective at construction: every rank's volume checked (:meth:`StepDrives.check`; a
    :class:`VolumeLayoutError` on any rank is raised on every rank, naming it), and
    ``ValueError`` unless the ranks of each node passed the same volume, every node a volume or
    every node a plain directory, and no drive folder serves two nodes."""
    problem: VolumeLayoutError | None = None
    try:
        if drives is not None:
            drives.check()
    except VolumeLayoutError as exc:
        problem = exc
    said = group.gather((None if drives is None else drives.folders, socket.gethostname(), describe(problem)),
                        thread="main", what="CheckpointManager() volumes")
    if bad := [(r, v[2][1]) for r, v in enumerate(said) if v[2] is not None]:
        if problem is not None:
            raise problem
        raise VolumeLayoutError(f"CheckpointManager: the volume of rank {bad[0][0]} does not open: {bad[0][1]}"
                                + "".join(f"; rank {r}: {m}" for r, m in bad[1:]), path=None)
    volumes = [v[0] for v in said]
    owner: dict[tuple[str, str], int] = {}  # (host, drive folder) -> the first node using it
    for i, ranks in enumerate(nodes):
        for folder in volumes[ranks[0]] or ():
            owner.setdefault((said[ranks[0]][1], os.path.realpath(folder)), i)
    shared = len(owner) < sum(len(volumes[n[0]] or ()) for n in nodes)
    split = any(len({volumes[r] for r in ranks}) > 1 for ranks in nodes)
    if len({v is None for v in volumes}) > 1 or split or shared:
        raise ValueError(f"CheckpointManager: the ranks passed different volumes or directories (drive folders "
                         f"by rank: {volumes}; nodes: {[list(n) for n in nodes]}); the ranks of a node pass "
                         "the same Volume, each node its own drives (no drive folder serves two nodes)")
