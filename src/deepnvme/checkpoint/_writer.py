"""The background writer of :class:`~deepnvme.CheckpointManager`: one thread, saves in order.

Each job is one step already turned into a torch.save skeleton in its hidden building
directory. The thread writes the tensor bytes (from the snapshot arena, or, fenced, from the
live tensors), fsyncs, computes checksums alongside, releases the arena or the fence, writes
the manifest, publishes the step directory and applies retention.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from ..errors import CheckpointFormatError, DeepNVMeIOError
from ..handles.aio import AioHandle
from ..io import durable
from ..io.file import reserve
from ._checksums import checksum, hasher
from ._fence import FencedWrite, write_fenced
from ._policy import retention_victims
from ._store import FILE, FORMAT, MANIFEST, delete_step, list_steps, step_dir
from ._stored import torch_skeleton
from .saver import StorageLayout

__all__ = ["Job", "Writer", "explain_failure", "check_restorable"]

log = logging.getLogger(__name__)


@dataclass
class Job:
    """One step to write. ``items``: arena slices and file offsets (snapshot mode), or None to
    write ``fenced`` (fenced mode: live storages, copied at the fence; see :mod:`._fence`).
    ``release`` runs once the tensor bytes are on disk and summed (frees the arena or ends the
    fenced write), whatever happens."""

    step: int
    building: str
    layout: StorageLayout
    names: dict[str, str]  # storage record key -> tensor name
    order: list[str]  # tensor names in manifest order
    items: list[tuple[torch.Tensor, int]] | None
    release: Callable[[], None]
    fenced: FencedWrite | None = None
    future: Future[None] = field(default_factory=Future)
    write_seconds: float = 0.0


class Writer:
    """Runs :class:`Job` s on one daemon thread through one :class:`AioHandle`."""

    def __init__(self, directory: str, *, handle: AioHandle, keep: int | None,
                 algorithm: str | None) -> None:
        self.directory = directory
        self._handle = handle
        self._keep = keep
        self._algorithm = algorithm
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="deepnvme-checkpoint-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        """Finish queued jobs, then end the thread."""
        self._jobs.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                self._write(job)
            except BaseException as exc:  # delivered by wait() / the next save()
                shutil.rmtree(job.building, ignore_errors=True)
                job.future.set_exception(explain_failure(exc, job.step, self.directory))
            else:
                job.future.set_result(None)

    def _write(self, job: Job) -> None:
        file = os.path.join(job.building, FILE)
        start = time.perf_counter()
        try:
            check_restorable(file, job.step)
            reserve(file, os.path.getsize(file))
            if job.fenced is not None:
                fn = None if self._algorithm is None else hasher(self._algorithm)
                checksums = {job.names[k]: v for k, v in write_fenced(self._handle, file, job.fenced, fn).items()}
            else:
                checksums = self._write_items(job, file)
        finally:
            job.release()
        job.write_seconds = time.perf_counter() - start
        nbytes = {job.names[key]: span.size for key, (_, span) in job.layout.items.items()}
        manifest = {"format": FORMAT, "version": 1, "step": job.step, "time": time.time(),
                    "file": FILE, "file_size": os.path.getsize(file), "checksum": self._algorithm,
                    "tensors": {name: {"nbytes": nbytes[name], "checksum": checksums.get(name)}
                                for name in job.order}}
        # a new file in the unpublished directory: publish_dir fsyncs it before the rename
        with open(os.path.join(job.building, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=1)
        durable.publish_dir(job.building, step_dir(self.directory, job.step))
        self._retire()

    def _retire(self) -> None:
        """Delete the oldest committed steps beyond ``keep``. The new step is committed by now,
        so a failure here is logged, not reported as a failed save; the next save tries again."""
        for old in retention_victims(list_steps(self.directory), self._keep):
            try:
                delete_step(self.directory, old)
            except OSError as exc:
                log.error("deepnvme.CheckpointManager: could not remove step %d from %r (keep=%s): %s; "
                          "the next save tries again", old, self.directory, self._keep, exc)
                return
            log.debug("deepnvme.CheckpointManager: removed step %d (keep=%s)", old, self._keep)

    def _write_items(self, job: Job, file: str) -> dict[str, int]:
        """Write the snapshot's arena slices, hashing them alongside; checksums by tensor name."""
        sums: Future[dict[str, int]] = Future()
        summer = threading.Thread(target=self._sum, args=(job, sums), daemon=True)
        summer.start()  # hashing overlaps the write; both only read the bytes
        self._handle.write_many(file, job.items or [], fsync=True).result()
        summer.join()
        return sums.result()

    def _sum(self, job: Job, out: Future[dict[str, int]]) -> None:
        try:
            if self._algorithm is None:
                out.set_result({})
                return
            fn = hasher(self._algorithm)
            sources = [dst for dst, _ in job.items or []]
            out.set_result({job.names[key]: checksum(fn, src)
                            for key, src in zip(job.layout.items, sources)})
        except BaseException as exc:
            out.set_exception(exc)


def check_restorable(file: str, step: int) -> None:
    """Refuse to commit a checkpoint that restore could not read back: the unpickler that reads it
    (PyTorch's ``weights_only`` one, as ``torch.load`` uses by default) refuses classes it does not
    know, e.g. a NumPy scalar or a user's dataclass among the plain data. Checked on the saved
    skeleton (no tensor bytes), so the error comes at the next ``save()``/``wait()``, not at a
    restore after a crash. Where torch has it, a scan of the pickle's globals against the
    unpickler's allowlist (what it refuses; 18 ms for 4000 tensors on the development machine,
    where unpickling the skeleton takes 0.3 s of the writer thread's CPU); else that unpickling."""
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
