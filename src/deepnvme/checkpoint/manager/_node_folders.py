"""A node's step folders for the multi-node tiers (:mod:`._nodes`, :mod:`._replicas`,
:mod:`._tiers`): its plain directory, or its folder on each drive of its volume (:mod:`._drives`).

On a volume every folder the tiers use (a step, a replica of another node's step, a hidden
building or gathering folder) exists under the same name below the manager folder of each drive;
each data file lies whole on one drive, and drive 0's folder holds ``.metadata``, the manifest
and a placement record (:mod:`.._placed`) naming every data file's drive. A folder is published
with the other drives' folders first and drive 0's last, which is what lists it, and removed
drive 0's first. On a plain directory every drive index is 0 and there is no placement record.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, Sequence

from ...io import durable
from .._placed import PLACEMENT_NAME, assign, write_placement
from ._drives import StepDrives
from ._steps import MANIFEST, delete_step, new_building, remove_leftovers, step_dir

__all__ = ["NodeFolders", "SHARED"]

SHARED = (".metadata", MANIFEST)  # a step's files in drive 0's folder beside its data files


class NodeFolders:
    """The step folders of this node: ``directory`` (drive 0's manager folder on a volume) and,
    on a volume, the same folders on the other drives (``drives``). Stateless; any thread."""

    def __init__(self, directory: str, drives: StepDrives | None) -> None:
        self.directory, self.drives = directory, drives

    @property
    def count(self) -> int:
        """The number of drives (1: a plain directory)."""
        return 1 if self.drives is None else len(self.drives.folders)

    def across(self, path: str) -> tuple[str, ...]:
        """The folder ``path`` (in or below ``directory``) on every drive, drive 0's first."""
        return (path,) if self.drives is None else self.drives.across(path)

    def files(self, path: str) -> dict[str, str]:
        """Each file of the folder ``path`` by name, on whichever drive it lies (drive 0's wins);
        a missing drive folder holds nothing."""
        return {n: os.path.join(here, n) for here in self.across(path)[::-1] if os.path.isdir(here)
                for n in os.listdir(here)}

    def drive_of(self, path: str) -> int:
        """The drive whose manager folder holds the file ``path`` (0 for a plain directory)."""
        if self.drives is None:
            return 0
        norm = os.path.normpath(path)
        return next((d for d, f in enumerate(self.drives.folders) if norm.startswith(os.path.normpath(f) + os.sep)), 0)

    def fill(self, found: Mapping[str, str]) -> list[int]:
        """Bytes per drive of the files ``found`` (name -> path, as :meth:`files` gives)."""
        out = [0] * self.count
        for path in found.values():
            out[self.drive_of(path)] += os.path.getsize(path)
        return out

    def place(self, sizes: Mapping[str, int], used: Sequence[int] | None = None) -> dict[str, int]:
        """A drive for each data file of ``sizes`` (name -> bytes), balanced by bytes on top of
        ``used`` bytes per drive (:func:`.._placed.assign`); ``.metadata`` and the manifest on
        drive 0. Pure."""
        data = {n: s for n, s in sizes.items() if n not in SHARED}
        return {**assign(data, self.count, used=used), **{n: 0 for n in sizes if n in SHARED}}

    def building(self, folder: str, step: int) -> str:
        """A new hidden building folder for ``step`` in ``folder`` (made if missing) on drive 0;
        :meth:`slot` makes its folder on another drive when a file goes there."""
        os.makedirs(folder, exist_ok=True)
        return new_building(folder, step)

    def slot(self, building: str, name: str, drive: int) -> str:
        """Where the file ``name`` of the folder ``building`` lies on ``drive`` (the folder
        made on that drive if missing)."""
        here = self.across(building)[drive]
        os.makedirs(here, exist_ok=True)
        return os.path.join(here, name)

    def seal(self, building: str, placed: Mapping[str, int], final: str | None = None) -> None:
        """On a volume: the placement record of ``building`` (``placed``: file -> drive; the
        shared files and the record itself left out), naming the folders as ``final`` (None: as
        ``building``) on every drive. Nothing on a plain directory."""
        if self.drives is None:
            return
        files = {n: d for n, d in placed.items() if n not in SHARED and n != PLACEMENT_NAME}
        write_placement(self.across(building), files, named=self.across(final or building))

    def publish(self, building: str, folder: str, step: int) -> None:
        """Publish ``building`` as ``step-N`` of ``folder`` (drive 0's folder last)."""
        if self.drives is None:
            durable.publish_dir(building, step_dir(folder, step))
        else:
            self.drives.publish(building, step, folder)

    def discard(self, building: str, folder: str | None = None, step: int | None = None) -> None:
        """Remove ``building`` on every drive, and with ``step``, that step's folders in ``folder``
        on other drives when drive 0's is not published (a commit that stopped half way)."""
        if self.drives is None:
            shutil.rmtree(building, ignore_errors=True)
        else:
            self.drives.discard(building, step, folder)

    def delete(self, folder: str, step: int) -> None:
        """Remove the committed ``step`` of ``folder``: drive 0's folder first (it is unlisted)."""
        if self.drives is None:
            delete_step(folder, step)
        else:
            self.drives.delete(step, None if os.path.normpath(folder) == os.path.normpath(self.directory)
                               else folder)

    def remove_leftovers(self, folder: str) -> None:
        """Remove the hidden folders killed work left in ``folder`` on every drive (and folders
        of steps on other drives that drive 0 does not list); each removal is logged."""
        if self.drives is None:
            remove_leftovers(folder)
        else:
            self.drives.remove_leftovers(folder)
