"""How a written step of :class:`~deepnvme.CheckpointManager` becomes a committed step.

The writer (:mod:`.._writer`) calls the commit once the step's file is written and fsynced in its
hidden building directory: the commit writes the manifest (sizes, checksums), publishes the
directory as ``step-N`` in one rename (:func:`deepnvme.io.durable.publish_dir`) and applies
retention. On a volume (:mod:`._drives`) the file's folder is published on its drive first and
drive 0's, holding the manifest, last. :class:`StepCommit` is the single-process commit; a manager spanning several
processes plugs in one that agrees across them before publishing, through the same calls.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass

import torch

from ...errors import CheckpointFormatError, DeepNVMeIOError
from ...formats.torchsave import torch_skeleton
from ...io import durable
from .._writer import Written
from ..saver import StorageLayout
from ._drives import StepDrives
from ._policy import retention_victims
from ._steps import FILE, FORMAT, MANIFEST, delete_step, list_steps, new_building, step_dir

__all__ = ["PendingStep", "StepCommit", "check_restorable", "explain_failure"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PendingStep:
    """One step being saved: its hidden directory and what the manifest needs to name. On a
    volume: the file's ``drive`` and, when that is not drive 0, drive 0's hidden directory
    (``home``) that gets the manifest."""

    step: int
    building: str
    layout: StorageLayout
    names: dict[str, str]  # storage record key -> tensor name
    order: list[str]  # tensor names in manifest order
    drive: int | None = None  # None: not on a volume
    home: str | None = None

    @property
    def file(self) -> str:
        return os.path.join(self.building, FILE)


class StepCommit:
    """Commits steps of one process into ``directory``: manifest, publish, retention (``keep``).
    Runs on the writer thread, one step at a time. ``drives``: the drive folders when
    ``directory`` is drive 0's folder of a volume."""

    def __init__(self, directory: str, *, keep: int | None, algorithm: str | None,
                 drives: StepDrives | None = None) -> None:
        self.directory = directory
        self.keep = keep
        self.algorithm = algorithm
        self.drives = drives

    def begin(self, step: int) -> tuple[str, int | None, str | None]:
        """The caller's thread: a new hidden building directory for ``step``'s file, the drive it
        lies on and drive 0's building directory when that is another (None, None: no volume)."""
        if self.drives is None:
            return new_building(self.directory, step), None, None
        drive = self.drives.choose(step, list_steps(self.directory), self.keep)
        try:
            building, home = self.drives.begin(step, drive)
        except BaseException:
            self.drives.forget(step)
            raise
        return building, drive, home

    def check(self, pending: PendingStep) -> None:
        """Before any tensor byte is written: refuse what restore could not read back."""
        check_restorable(pending.file, pending.step)

    def commit(self, pending: PendingStep, written: Written) -> None:
        """Write the manifest, publish ``step-N``, then apply retention."""
        layout, file = pending.layout, pending.file
        nbytes = {pending.names[key]: span.size for key, (_, span) in layout.items.items()}
        sums = {pending.names[key]: value for key, value in written.checksums.items()}
        size = os.path.getsize(file)
        manifest = {"format": FORMAT, "version": 1, "step": pending.step, "time": time.time(),
                    "file": FILE, "file_size": size, "checksum": self.algorithm,
                    "tensors": {name: {"nbytes": nbytes[name], "checksum": sums.get(name)}
                                for name in pending.order}}
        if self.drives is not None and pending.drive is not None:
            manifest |= {"drive": pending.drive, "drives": list(self.drives.folders)}
        # a new file in the unpublished directory: publish_dir fsyncs it before the rename
        with open(os.path.join(pending.home or pending.building, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
        if self.drives is not None and pending.drive is not None and pending.home is not None:
            durable.publish_dir(pending.building, step_dir(self.drives.folders[pending.drive], pending.step))
            durable.publish_dir(pending.home, step_dir(self.directory, pending.step))  # lists the step
        else:
            durable.publish_dir(pending.building, step_dir(self.directory, pending.step))
        if self.drives is not None and pending.drive is not None:
            self.drives.placed(pending.step, pending.drive, size)
        self.retire()

    def abort(self, pending: PendingStep, exc: BaseException) -> BaseException:
        """Remove the step's building directories (and, on a volume, its file's published folder
        when drive 0's was not published); the error to report (:func:`explain_failure`)."""
        self.discard(pending.step, pending.building, pending.drive, pending.home)
        return explain_failure(exc, pending.step, self.directory)

    def discard(self, step: int, building: str, drive: int | None, home: str | None) -> None:
        """Remove what an unfinished save of ``step`` made (a step already listed is kept)."""
        shutil.rmtree(building, ignore_errors=True)
        if home is not None:
            shutil.rmtree(home, ignore_errors=True)
        if self.drives is not None and drive is not None:
            if drive and not os.path.isdir(step_dir(self.directory, step)):
                shutil.rmtree(step_dir(self.drives.folders[drive], step), ignore_errors=True)
            self.drives.forget(step)

    def retire(self) -> None:
        """Delete the oldest committed steps beyond ``keep``. The new step is committed by now,
        so a failure here is logged, not reported as a failed save; the next save tries again."""
        for old in retention_victims(list_steps(self.directory), self.keep):
            try:
                if self.drives is None:
                    delete_step(self.directory, old)
                else:
                    self.drives.delete(old)
            except OSError as exc:
                log.error("deepnvme.CheckpointManager: could not remove step %d from %r (keep=%s): %s; "
                          "the next save tries again", old, self.directory, self.keep, exc)
                return
            log.debug("deepnvme.CheckpointManager: removed step %d (keep=%s)", old, self.keep)


def check_restorable(file: str, step: int) -> None:
    """Refuse to commit a checkpoint that restore could not read back: the unpickler that reads it
    (PyTorch's ``weights_only`` one, as ``torch.load`` uses by default) refuses classes it does not
    know, e.g. a NumPy scalar or a user's dataclass among the plain data. Checked on the saved
    skeleton (no tensor bytes), so the error comes at the next ``save()``/``wait()``, not at a
    restore after a crash: where torch has it, a scan of the pickle's globals against the
    unpickler's allowlist (cheap next to unpickling), else unpickling the skeleton."""
    scan = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    try:
        if scan is None:
            torch_skeleton(file)
        elif unsafe := sorted(scan(file)):
            raise CheckpointFormatError(f"{file!r} holds classes that torch.load(weights_only=True) "
                                        f"refuses: {unsafe}")
    except CheckpointFormatError as exc:
        raise CheckpointFormatError(
            f"checkpoint step {step} was not saved: restore could not read it back ({exc}). Keep plain "
            "data to builtins, containers and tensors (e.g. float() of a NumPy scalar), or register "
            "its classes with torch.serialization.add_safe_globals before saving and restoring") from exc


def explain_failure(exc: BaseException, step: int, directory: str) -> BaseException:
    """The error a failed save reports: I/O errors become a :class:`DeepNVMeIOError` with the same
    errno that names the step (the original is its ``__cause__``); others are logged with the step."""
    if isinstance(exc, OSError):
        err = DeepNVMeIOError(f"checkpoint step {step} was not saved in {directory!r}, earlier "
                              f"checkpoints are intact: {exc}", path=getattr(exc, "path", exc.filename),
                              offset=getattr(exc, "offset", None), size=getattr(exc, "size", None),
                              errno=exc.errno)
        err.__cause__ = exc
        return err
    log.error("deepnvme.CheckpointManager: step %d was not saved in %r: %r", step, directory, exc)
    return exc
