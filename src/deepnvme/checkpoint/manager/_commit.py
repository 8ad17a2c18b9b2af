"""How a written step of :class:`~deepnvme.CheckpointManager` becomes a committed step.

The writer (:mod:`.._writer`) calls the commit once the step's file is written and fsynced in its
hidden building directory: the commit writes the manifest (sizes, checksums), publishes the
directory as ``step-N`` in one rename (:func:`deepnvme.io.durable.publish_dir`) and applies
retention. :class:`StepCommit` is the single-process commit; a manager spanning several
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
from ._policy import retention_victims
from ._steps import FILE, FORMAT, MANIFEST, delete_step, list_steps, new_building, step_dir

__all__ = ["PendingStep", "StepCommit", "check_restorable", "explain_failure"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PendingStep:
    """One step being saved: its hidden directory and what the manifest needs to name."""

    step: int
    building: str
    layout: StorageLayout
    names: dict[str, str]  # storage record key -> tensor name
    order: list[str]  # tensor names in manifest order

    @property
    def file(self) -> str:
        return os.path.join(self.building, FILE)


class StepCommit:
    """Commits steps of one process into ``directory``: manifest, publish, retention (``keep``).
    Runs on the writer thread, one step at a time."""

    def __init__(self, directory: str, *, keep: int | None, algorithm: str | None) -> None:
        self.directory = directory
        self.keep = keep
        self.algorithm = algorithm

    def begin(self, step: int) -> str:
        """A new hidden building directory for ``step`` (the caller's thread)."""
        return new_building(self.directory, step)

    def check(self, pending: PendingStep) -> None:
        """Before any tensor byte is written: refuse what restore could not read back."""
        check_restorable(pending.file, pending.step)

    def commit(self, pending: PendingStep, written: Written) -> None:
        """Write the manifest, publish ``step-N``, then apply retention."""
        layout, file = pending.layout, pending.file
        nbytes = {pending.names[key]: span.size for key, (_, span) in layout.items.items()}
        sums = {pending.names[key]: value for key, value in written.checksums.items()}
        manifest = {"format": FORMAT, "version": 1, "step": pending.step, "time": time.time(),
                    "file": FILE, "file_size": os.path.getsize(file), "checksum": self.algorithm,
                    "tensors": {name: {"nbytes": nbytes[name], "checksum": sums.get(name)}
                                for name in pending.order}}
        # a new file in the unpublished directory: publish_dir fsyncs it before the rename
        with open(os.path.join(pending.building, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
        durable.publish_dir(pending.building, step_dir(self.directory, pending.step))
        self.retire()

    def abort(self, step: int, building: str, exc: BaseException) -> BaseException:
        """Remove the step's building directory; the error to report (:func:`explain_failure`)."""
        shutil.rmtree(building, ignore_errors=True)
        return explain_failure(exc, step, self.directory)

    def retire(self) -> None:
        """Delete the oldest committed steps beyond ``keep``. The new step is committed by now,
        so a failure here is logged, not reported as a failed save; the next save tries again."""
        for old in retention_victims(list_steps(self.directory), self.keep):
            try:
                delete_step(self.directory, old)
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
