"""``deepnvme.CheckpointManager``: the checkpoint loop of a training job in one object.

Where checkpoints go (``DIR/step-N``, see :mod:`._store`), which are due (orbax's interval
rule), how many stay (``keep``), the newest complete one after a crash, bit-exact resume
(state dicts, tensors, plain data and RNG states) and optional per-tensor checksums. Saves are
asynchronous, in one of two modes:

* ``"snapshot"``: ``save()`` copies every tensor into a reused page-locked arena (size: sum of
  the storages, each rounded up to 4096 bytes; ``snapshot_arenas`` of them at most, so locked
  memory up to ``snapshot_arenas x`` that sum) and returns; a background thread writes it. The
  caller waits for the copy, and for an earlier save when every arena is still being written.
* ``"fenced"``: no copy at ``save()``; the background thread writes straight from the live CPU
  tensors, those each optimizer in ``state`` changes first (in the order the optimizers stepped
  at the previous save). Each such optimizer gets a step pre-hook: at its next ``step()``, the
  pending saves' tensors it changes, and those no optimizer in ``state`` owns, that are not
  written yet are copied into a reused locked staging arena and the step goes on; the rest of
  the save is written from the copies (:mod:`._fence`). Where the arena
  (``fence_staging_bytes``) is too small, the step waits for the write instead. Requirement:
  between ``save()`` and that ``step()``, nothing else may change a saved tensor in place (e.g.
  BatchNorm running stats in ``forward``, a manual ``param.add_``, an optimizer not in
  ``state``); call :meth:`wait` first or use ``"snapshot"`` for such loops. Gradients are not
  saved, so ``backward`` is free to run.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from ..config import IOConfig, checkpoint_config
from ..errors import CheckpointMismatchError, FileNotFoundIOError
from ..handles.aio import AioHandle
from ..io.plan import align_up
from ..memory.copy import ParallelCopy
from ..memory.pinned import free_cpu_locked_tensor
from ..memory.views import storage_bytes
from ._checksums import named_storages, record_names, resolve_algorithm
from ._fence import FencedWrite, Staging, plan_fenced
from ._lock import DirectoryLock, tidy, try_lock
from ._paths import as_path
from ._policy import check_policy, is_due
from ._restore import restore_state
from ._rng import capture_rng, restore_rng
from ._store import FILE, list_steps, new_building, remove_leftovers, step_dir
from ._verify import load_checked
from ._writer import Job, Writer, explain_failure
from .async_saver import ensure_arena
from .saver import StorageLayout, write_skeleton

__all__ = ["CheckpointManager", "SaveStats", "RNG_KEY"]

log = logging.getLogger(__name__)

RNG_KEY = "_deepnvme_rng"  # the reserved entry holding RNG states in a saved checkpoint


@dataclass(frozen=True)
class SaveStats:
    """What this manager's saves cost the training thread so far (seconds, cumulative)."""

    saves: int
    blocked_seconds: float  # inside save() plus fenced optimizer steps waiting
    fence_wait_seconds: float  # the fenced optimizer steps' part of blocked_seconds
    arena_wait_seconds: float  # snapshot: save() waiting for the previous write to free the arena
    last_write_seconds: float  # background: the newest finished save's write + fsync
    fence_copied_bytes: int = 0  # fenced: bytes the optimizer step pre-hooks copied into staging
    fence_precopied_bytes: int = 0  # fenced with fence_precopy: bytes copied in the background


class CheckpointManager:
    """Saves ``state`` dicts of a training loop into ``directory`` and restores them.

    ``state`` holds modules, optimizers, LR schedulers (anything with ``state_dict()``), tensors
    and plain data that ``torch.load(weights_only=True)`` reads back (builtins, containers;
    other classes once registered with ``torch.serialization.add_safe_globals``; a save holding
    anything else fails, see :func:`._writer.check_restorable`).
    ``keep``: newest committed checkpoints kept (None: all). ``every_steps``/``every_seconds``:
    when ``save()`` writes (neither: every call). ``mode``: ``"snapshot"`` or ``"fenced"`` (module
    docstring). ``checksums``: False, True (``"crc32c"``), ``"crc32c"`` or ``"xxh64"``. ``rng``:
    save and restore RNG states. ``snapshot_arenas``: staging arenas of snapshot mode (the
    second is allocated only when a save finds the first still being written).
    ``fence_staging_bytes`` (fenced mode): the copy-on-fence arena's
    cap in bytes (None: as large as a save's tensors over 256 KiB, allocated at the first fence
    that copies; 0: never copy, the step waits for the write); ``fence_precopy``: start those
    copies in the background at ``save()`` (see :mod:`._fence`). One thread drives a manager; one
    manager may write a directory at a time (:class:`CheckpointLockedError` for a second);
    reading needs no lock and creates nothing: ``directory`` and its lock file are made at the
    first save.
    """

    def __init__(self, directory: str | os.PathLike[str], *, keep: int | None = 3,
                 every_steps: int | None = None, every_seconds: float | None = None,
                 mode: Literal["snapshot", "fenced"] = "snapshot", checksums: bool | str = False,
                 rng: bool = True, config: IOConfig | Mapping[str, Any] | None = None,
                 snapshot_arenas: int = 1, fence_staging_bytes: int | None = None,
                 fence_precopy: bool = False) -> None:
        check_policy(keep=keep, every_steps=every_steps, every_seconds=every_seconds)
        if mode not in ("snapshot", "fenced"):
            raise ValueError(f"CheckpointManager: mode must be 'snapshot' or 'fenced', got {mode!r}")
        self.directory = os.path.abspath(as_path(directory, "CheckpointManager"))
        self.keep, self.every_steps, self.every_seconds = keep, every_steps, every_seconds
        self.mode, self.rng = mode, rng
        self._algorithm = resolve_algorithm(checksums)
        self._config = checkpoint_config(config)
        self._lock: DirectoryLock | None = None
        self._handle: AioHandle | None = None
        self._writer: Writer | None = None
        self._pending: list[Job] = []
        self._last_step: int | None = None
        self._last_start = time.monotonic()
        if isinstance(snapshot_arenas, bool) or not isinstance(snapshot_arenas, int) or snapshot_arenas < 1:
            raise ValueError(f"CheckpointManager: snapshot_arenas must be an int >= 1, got {snapshot_arenas!r}")
        self._arenas: list[torch.Tensor | None] = [None] * snapshot_arenas
        self._arena_free = [True] * snapshot_arenas
        self._arena_cond = threading.Condition()
        self._staging = Staging(fence_staging_bytes)
        self._precopy = bool(fence_precopy)
        self._fences: list[FencedWrite] = []
        self._fence_order: list[int] = []  # id()s of optimizers in the order they last fenced
        self._hooks: dict[int, Any] = {}
        self._closed = False
        self._saves, self._blocked, self._fence_wait, self._last_write = 0, 0.0, 0.0, 0.0
        self._arena_wait, self._fence_copied, self._fence_precopied = 0.0, 0, 0
        tidy(self.directory)  # leftovers of killed runs, if no writer holds the directory

    # ---- saving -------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], *, force: bool = False) -> bool:
        """Start saving ``state`` as ``step`` if it is due (or ``force``); False if not due.

        Returns once the loop may go on (snapshot: after the copy; fenced: at once). Raises
        ``ValueError`` for a step not greater than the newest saved or started one, the error of
        an earlier failed save not yet reported, and a :class:`DeepNVMeIOError` naming the step
        when writing the file's skeleton fails here (a full disk); a save that fails here is not
        counted (its step may be saved again; ``every_seconds`` still counts from the last save
        that started writing, timed from the start of its ``save()`` call).
        """
        start, started = time.perf_counter(), time.monotonic()
        self._check_open()
        self._raise_failures()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"CheckpointManager.save: step must be an int >= 0, got {step!r}")
        committed = list_steps(self.directory)
        newest = max([*committed[-1:], *([] if self._last_step is None else [self._last_step])], default=None)
        if newest is not None and step <= newest:
            raise ValueError(f"CheckpointManager.save: step {step} is not greater than the newest saved "
                             f"step {newest} in {self.directory!r}")
        due = is_due(step, first=newest is None, every_steps=self.every_steps,
                     every_seconds=self.every_seconds, seconds_since_last=started - self._last_start)
        if not (due or force):
            return False
        saved = self._collect(state)
        writer = self._start_writer()
        building: str | None = None
        items: list[tuple[torch.Tensor, int]] | None = None
        fenced: FencedWrite | None = None
        release: Callable[[], None] | None = None
        try:
            building = new_building(self.directory, step)
            file = os.path.join(building, FILE)
            if self.mode == "snapshot":
                layout, items, release = self._snapshot(saved, file)
            else:
                layout = write_skeleton(saved, file)
                fenced, release = self._fence(state, layout, file)
            names, order = record_names(saved, layout)
        except BaseException as exc:
            if release is not None:
                release()
            if building is not None:
                shutil.rmtree(building, ignore_errors=True)
            if isinstance(exc, OSError):  # e.g. ENOSPC while writing the skeleton: name the step
                raise explain_failure(exc, step, self.directory) from exc
            raise
        # only a save that got this far counts: a failed one neither blocks its step nor the clock
        self._last_start, self._last_step = started, step
        job = Job(step=step, building=building, layout=layout, names=names, order=order,
                  items=items, release=release, fenced=fenced)
        self._pending.append(job)
        writer.submit(job)
        self._saves += 1
        self._blocked += time.perf_counter() - start
        return True

    def _collect(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """What is saved: state dicts of objects, tensors (detached), plain data, RNG states."""
        saved: dict[str, Any] = {}
        for name, value in state.items():
            if not isinstance(name, str) or name == RNG_KEY:
                raise ValueError(f"CheckpointManager.save: state keys must be str other than {RNG_KEY!r}, "
                                 f"got {name!r}")
            if isinstance(value, torch.Tensor):
                saved[name] = value.detach()
            elif callable(getattr(value, "state_dict", None)):
                saved[name] = value.state_dict()
            else:
                saved[name] = value
        if self.rng:
            saved[RNG_KEY] = capture_rng()
        if self.mode == "fenced":
            for tname, storage in named_storages(saved):
                if storage.device.type != "cpu":
                    raise ValueError(f"CheckpointManager(mode='fenced') writes from live CPU tensors; "
                                     f"{tname!r} is on {storage.device}: use mode='snapshot'")
        return saved

    def _start_writer(self) -> Writer:
        if self._writer is None:
            self._lock = try_lock(self.directory)
            remove_leftovers(self.directory)
            self._handle = AioHandle(config=self._config)
            self._writer = Writer(self.directory, handle=self._handle, keep=self.keep,
                                  algorithm=self._algorithm)
        return self._writer

    def _snapshot(self, saved: Mapping[str, Any], file: str
                  ) -> tuple[StorageLayout, list[tuple[torch.Tensor, int]], Callable[[], None]]:
        """Copy the storages into the arena (waiting until the previous save released it) while
        the caller's thread writes the skeleton; each storage's (arena slice, file offset)."""
        idx = self._take_arena()
        try:
            storages = [st for _, st in named_storages(saved)]
            arena, self._arenas[idx] = self._arenas[idx], None  # never keep a freed arena if allocation fails
            self._arenas[idx] = arena = ensure_arena(arena, (st.nbytes() for st in storages))
            copy, slots, pos = ParallelCopy(), {}, 0
            try:
                for st in storages:  # copies start now, on the pool's threads
                    n = st.nbytes()
                    slots[st._cdata] = dst = arena[pos:pos + n]
                    if n:
                        copy.add(dst, storage_bytes(st))
                    pos += align_up(n, 4096)
                layout = write_skeleton(saved, file)
            finally:
                copy.finish()
            # a storage the walk missed is refused by _record_names before anything is written
            items = [(slots[st._cdata], span.offset) for st, span in layout.items.values() if st._cdata in slots]
        except BaseException:
            self._give_arena(idx)
            raise
        return layout, items, lambda: self._give_arena(idx)

    def _take_arena(self) -> int:
        """A free arena's index (an allocated one first), waiting until the writer frees one."""
        start = time.perf_counter()
        with self._arena_cond:
            while not any(self._arena_free):
                self._arena_cond.wait()
            free = [i for i, ok in enumerate(self._arena_free) if ok]
            idx = next((i for i in free if self._arenas[i] is not None), free[0])
            self._arena_free[idx] = False
        self._arena_wait += time.perf_counter() - start
        return idx

    def _give_arena(self, idx: int) -> None:
        with self._arena_cond:
            self._arena_free[idx] = True
            self._arena_cond.notify_all()

    def _fence(self, state: Mapping[str, Any], layout: StorageLayout, file: str
               ) -> tuple[FencedWrite, Callable[[], None]]:
        """Hook every optimizer in ``state`` (once) and plan the save's writes (:func:`plan_fenced`)."""
        optimizers = [v for v in state.values() if isinstance(v, torch.optim.Optimizer)]
        for opt in optimizers:
            if id(opt) not in self._hooks:
                self._hooks[id(opt)] = opt.register_step_pre_hook(self._wait_fences)
        fenced = plan_fenced(optimizers, self._fence_order, layout, file, self._staging)
        if self._precopy:
            after = self._fences[-1] if self._fences else None
            threading.Thread(target=fenced.precopy, args=(after,), name="deepnvme-fence-precopy",
                             daemon=True).start()
        self._fences.append(fenced)
        self._fence_order = []

        def release() -> None:
            fenced.end()
            self._fences.remove(fenced)
            self._fence_copied += fenced.copied_bytes
            self._fence_precopied += fenced.precopied_bytes
        return fenced, release

    def _wait_fences(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._fences:
            return
        start = time.perf_counter()
        if id(optimizer) not in self._fence_order:
            self._fence_order.append(id(optimizer))
        for fenced in list(self._fences):
            fenced.protect(id(optimizer))
        waited = time.perf_counter() - start
        self._fence_wait += waited
        self._blocked += waited

    # ---- completion -----------------------------------------------------------------------

    def wait(self) -> None:
        """Block until every save started so far is committed; raise the first failure not
        reported yet."""
        for job in list(self._pending):
            job.future.exception()
        self._raise_failures()

    def _raise_failures(self) -> None:
        done = [job for job in self._pending if job.future.done()]
        self._pending = [job for job in self._pending if not job.future.done()]
        for job in done:
            self._last_write = job.write_seconds or self._last_write
        for job in done:
            exc = job.future.exception()
            if exc is not None:
                self._last_step = max(list_steps(self.directory), default=None)
                raise exc

    def close(self) -> None:
        """Wait for pending saves, then release the thread, arena, hooks and lock (idempotent).
        Raises the first failure not reported yet, after releasing everything."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._writer is not None:
                self._writer.stop()
            self.wait()
        finally:
            for hook in self._hooks.values():
                hook.remove()
            self._hooks.clear()
            self._staging.close()
            for i, arena in enumerate(self._arenas):
                if arena is not None:
                    free_cpu_locked_tensor(arena)
                    self._arenas[i] = None
            if self._handle is not None:
                self._handle.close()
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as err:  # the body's exception is the one to see
            log.error("deepnvme.CheckpointManager: a save failed while closing: %s", err)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"CheckpointManager({self.directory!r}) is closed")

    @property
    def stats(self) -> SaveStats:
        """Cumulative cost of this manager's saves to the caller (see :class:`SaveStats`)."""
        return SaveStats(saves=self._saves, blocked_seconds=self._blocked,
                         fence_wait_seconds=self._fence_wait, arena_wait_seconds=self._arena_wait,
                         last_write_seconds=self._last_write,
                         fence_copied_bytes=self._fence_copied + sum(f.copied_bytes for f in self._fences),
                         fence_precopied_bytes=self._fence_precopied + sum(f.precopied_bytes for f in self._fences))

    # ---- reading --------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The committed steps, ascending. A step is listed once its background write committed
        (only complete checkpoints are ever listed): call :meth:`wait` first to see a save still
        in flight."""
        return list_steps(self.directory)

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return max(self.steps(), default=None)

    def load(self, step: int | None = None, *, map_location: Any = None) -> dict[str, Any]:
        """The saved entries of ``step`` (default: the newest) by name: state dicts for objects,
        tensors and plain data, as passed to ``save`` (the RNG states are :meth:`restore`'s).
        Verifies sizes and any stored checksums (:class:`CheckpointCorruptError`). Blocks; waits
        for this manager's pending saves."""
        if self._writer is not None and not self._closed:
            self.wait()
        chosen = self._resolve(step)
        obj, _ = load_checked(step_dir(self.directory, chosen), chosen, map_location=map_location,
                              config=self._config)
        if not isinstance(obj, dict):
            raise CheckpointMismatchError(f"step {chosen} in {self.directory!r} holds a {type(obj).__name__}")
        obj.pop(RNG_KEY, None)
        return obj

    def restore(self, state: MutableMapping[str, Any], step: int | None = None, *, strict: bool = True) -> int:
        """Load ``step`` (default: the newest) into ``state`` in place and return the step.

        Objects get ``load_state_dict``, tensors ``copy_``, plain data replaces ``state[name]``;
        RNG states are restored when saved and ``rng=True``. The names of ``state`` and the
        checkpoint must match, and so must the names and shapes of a module's state dict
        (:class:`CheckpointMismatchError` before anything changes). ``strict=False`` restores
        part of a checkpoint: names (and module state dict keys) on one side only are left
        out, e.g. a model restored without its optimizer; shapes must still match. Bytes are read straight
        into the existing tensors (parameters, buffers, optimizer state, tensors in ``state``)
        where dtype and shape match, else into new memory (:mod:`._restore`); O_DIRECT lands
        in a tensor directly only when it is page-aligned, as PyTorch makes allocations of 2 MiB
        and more when the process runs with ``THP_MEM_ALLOC_ENABLE=1``. Stored checksums
        are checked on the bytes read: a :class:`CheckpointCorruptError` then comes after the
        state's tensors were overwritten, as can an I/O error.
        """
        if self._writer is not None and not self._closed:
            self.wait()
        chosen = self._resolve(step)
        saved = restore_state(step_dir(self.directory, chosen), chosen, state, self._config,
                              what=f"step {chosen} in {self.directory!r}", rng_key=RNG_KEY, strict=strict)
        if self.rng and RNG_KEY in saved:
            restore_rng(saved[RNG_KEY])
        return chosen

    def _resolve(self, step: int | None) -> int:
        steps = self.steps()
        if step is None and steps:
            return steps[-1]
        if step is not None and step in steps:
            return step
        want = "no checkpoint" if step is None else f"no checkpoint of step {step}"
        raise FileNotFoundIOError(f"{want} in {self.directory!r} (committed steps: {steps})",
                                  path=self.directory, offset=None, size=None, errno=2)

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, mode={self.mode!r}, keep={self.keep}, "
                f"steps={self.steps()})")

