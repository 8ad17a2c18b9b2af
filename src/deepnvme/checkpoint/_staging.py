"""Stagers: how an asynchronous save gets an image of the tensors that training cannot tear.

A :class:`Stager` serves one saver (:class:`~deepnvme.AsyncCheckpointer` or
:class:`~deepnvme.CheckpointManager`); its calls come in this order, for every save:

1. :meth:`Stager.stage` on the caller's thread: writes ``obj``'s torch.save skeleton (the zip
   without tensor bytes) into ``file`` and makes the tensor bytes safe from what the caller does
   next. Returns a :class:`Staged`. The caller may change its tensors once ``stage`` returns,
   within the stager's rules.
2. :attr:`Staged.write` on the background writer (:mod:`._writer`): writes every storage's bytes
   into its record of ``file`` and fsyncs it; returns checksums by record key when given a hash.
3. :attr:`Staged.release`, exactly once, when the bytes are on disk or the save failed: the
   staging memory goes back to the arena pool, the fence ends.

:meth:`Stager.close` runs when the saver closes, after every staged save was released.

Two stagers: :class:`SnapshotStager` copies every tensor at ``stage()`` (the caller waits for
the copy); :class:`FencedStager` copies nothing at ``stage()`` and writes from the live tensors,
copying at the next optimizer step only what is not written by then (:mod:`._fence`). Both take
their staging memory from :class:`~._arena.ArenaPool`.
"""

from __future__ import annotations

import abc
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..handles.aio import AioHandle
from ..memory.copy import ParallelCopy
from ..memory.views import byte_view, storage_bytes
from ._arena import ArenaPool, arena_bytes
from ._fence import FencedWrite, Staging, plan_fenced, write_fenced
from ._tree import named_storages
from .saver import StorageLayout, write_skeleton

__all__ = ["FencedStager", "HashFn", "SnapshotStager", "Staged", "Stager", "StagingStats", "resolve_stager"]

HashFn = Callable[[Any], int]
"""A checksum function over a buffer (``memoryview``), e.g. ``crc32c.crc32c``."""


@dataclass(frozen=True)
class StagingStats:
    """What a stager cost the caller so far (cumulative)."""

    arena_wait_seconds: float = 0.0  # stage() waiting for an arena still being written
    fence_wait_seconds: float = 0.0  # optimizer steps waiting at a fence
    copied_bytes: int = 0  # bytes the fences copied on the caller's thread
    precopied_bytes: int = 0  # bytes copied in the background before a fence


@dataclass
class Staged:
    """One staged save: its layout, how the writer writes it, and its one-time release."""

    layout: StorageLayout
    write: Callable[[AioHandle, str, HashFn | None], dict[str, int]]
    _release: Callable[[], None]
    _released: bool = field(default=False, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def release(self) -> None:
        """Give back the staging memory / end the fence (only the first call acts)."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self._release()


class Stager(abc.ABC):
    """Makes a save's tensor bytes independent of training until they are on disk (module
    docstring: call order). One saver uses a stager; ``stage`` runs on that saver's thread."""

    name: str = "custom"

    @abc.abstractmethod
    def stage(self, obj: Any, file: str, *, state: Mapping[str, Any] | None = None) -> Staged:
        """Write ``obj``'s skeleton into ``file`` and return what the writer writes. ``state``:
        the live objects ``obj`` was made from (a manager's state: modules, optimizers), if any.
        Blocks the caller for the stager's share of the save."""

    def stats(self) -> StagingStats:
        """Cumulative cost of this stager's saves to the caller."""
        return StagingStats()

    def close(self) -> None:  # noqa: B027 (optional: a stager holding no memory has nothing to free)
        """Free the staging memory (every staged save is released by now). Idempotent."""


def _write_hashing(handle: AioHandle, file: str, items: list[tuple[torch.Tensor, int]],
                   keys: list[str], hash_fn: HashFn | None) -> dict[str, int]:
    """Write ``items`` (memory, file offset) into ``file`` and fsync, hashing them alongside
    (both only read the bytes); each key's checksum when ``hash_fn`` is given."""
    sums: dict[str, int] = {}
    failed: list[BaseException] = []

    def hash_all() -> None:
        try:
            sums.update({k: hash_fn(byte_view(src)) for k, (src, _) in zip(keys, items)})  # type: ignore[misc]
        except BaseException as exc:
            failed.append(exc)

    summer = threading.Thread(target=hash_all, name="deepnvme-checksum", daemon=True)
    if hash_fn is not None:
        summer.start()
    try:
        handle.write_many(file, items, fsync=True).result()
    finally:
        if hash_fn is not None:
            summer.join()
    if failed:
        raise failed[0]
    return sums


class SnapshotStager(Stager):
    """Copies every tensor into a reused page-locked arena while the skeleton is written; the
    writer writes the copy, so the caller may change its tensors as soon as ``stage`` returns.

    ``arenas``: arenas in the pool (>= 1). A save that finds every arena still being written
    waits for the oldest; a second arena is allocated only when a save finds the first one busy.
    Memory: ``arenas x`` the largest save's storages, each rounded up to 4096 bytes.
    CPU and CUDA tensors alike (a CUDA tensor is copied to the host arena).
    """

    name = "snapshot"

    def __init__(self, *, arenas: int = 1) -> None:
        self.arenas = arenas
        self._pool = ArenaPool(arenas, what="SnapshotStager: arenas")

    def stage(self, obj: Any, file: str, *, state: Mapping[str, Any] | None = None) -> Staged:
        walked = [st for _, st in named_storages(obj)]
        lease = self._pool.take(arena_bytes(st.nbytes() for st in walked))
        try:
            layout, items = self._copy(lease.tensor, walked, obj, file)
            missed = [(k, st) for k, (st, _) in layout.items.items() if k not in items]
            if missed:  # storages inside other objects: copied once the skeleton named them
                end = max((off + arena_bytes([n]) for off, n in items.values()), default=0)
                arena = lease.grow(end + arena_bytes(st.nbytes() for _, st in missed), keep=end)
                copy = ParallelCopy()
                for key, st in missed:
                    n = st.nbytes()
                    if n:
                        copy.add(arena[end:end + n], storage_bytes(st))
                    items[key] = (end, n)
                    end += arena_bytes([n])
                copy.finish()
        except BaseException:
            lease.release()
            raise
        arena = lease.tensor
        keys = list(layout.items)
        writes = [(arena[items[k][0]:items[k][0] + items[k][1]], layout.items[k][1].offset) for k in keys]

        def write(handle: AioHandle, path: str, hash_fn: HashFn | None) -> dict[str, int]:
            return _write_hashing(handle, path, writes, keys, hash_fn)

        return Staged(layout, write, lease.release)

    @staticmethod
    def _copy(arena: torch.Tensor, storages: list[torch.UntypedStorage], obj: Any, file: str
              ) -> tuple[StorageLayout, dict[str, tuple[int, int]]]:
        """Copy ``storages`` into ``arena`` on the copy pool while this thread writes the
        skeleton; each record's (arena offset, bytes) for the storages copied."""
        copy, slots, pos = ParallelCopy(), {}, 0
        try:
            for st in storages:  # copies start now, on the pool's threads
                n = st.nbytes()
                slots[st._cdata] = (pos, n)
                if n:
                    copy.add(arena[pos:pos + n], storage_bytes(st))
                pos += arena_bytes([n])
            layout = write_skeleton(obj, file)
        finally:
            copy.finish()
        items = {k: slots[st._cdata] for k, (st, _) in layout.items.items() if st._cdata in slots}
        return layout, items

    def stats(self) -> StagingStats:
        return StagingStats(arena_wait_seconds=self._pool.wait_seconds)

    def close(self) -> None:
        self._pool.close()


class FencedStager(Stager):
    """Copies nothing at ``stage``: the writer writes from the live CPU tensors, those each
    optimizer in ``state`` changes first. Each such optimizer gets a step pre-hook: at its next
    ``step()``, the pending saves' tensors it changes (and those no optimizer in ``state`` owns)
    that are not written yet are copied into a reused locked arena and the step goes on.

    ``staging_bytes``: that arena's cap in bytes (None: as large as a save's tensors over
    256 KiB, allocated at the first fence that copies; 0: never copy, the step waits for the
    write). ``precopy``: start those copies in the background at ``stage()`` (costs memory
    bandwidth during forward and backward). Requirement: between the save and that ``step()``,
    nothing else changes a saved tensor in place (BatchNorm running stats in ``forward``, a
    manual ``param.add_``, an optimizer not in ``state``); use :class:`SnapshotStager` there.
    Gradients are not saved, so ``backward`` is free to run. CPU tensors only.
    """

    name = "fenced"

    def __init__(self, *, staging_bytes: int | None = None, precopy: bool = False) -> None:
        self.staging_bytes = staging_bytes
        self.precopy = bool(precopy)
        self._staging = Staging(staging_bytes)
        self._fences: list[FencedWrite] = []
        self._order: list[int] = []  # id()s of optimizers in the order they last fenced
        self._hooks: dict[int, Any] = {}
        self._fence_wait, self._copied, self._precopied = 0.0, 0, 0

    def stage(self, obj: Any, file: str, *, state: Mapping[str, Any] | None = None) -> Staged:
        for tname, storage in named_storages(obj):
            if storage.device.type != "cpu":
                raise ValueError(f"the fenced stager writes from live CPU tensors; {tname!r} is on "
                                 f"{storage.device}: use staging='snapshot'")
        layout = write_skeleton(obj, file)
        optimizers = [v for v in (state or {}).values() if isinstance(v, torch.optim.Optimizer)]
        for opt in optimizers:
            if id(opt) not in self._hooks:
                self._hooks[id(opt)] = opt.register_step_pre_hook(self._wait_fences)
        fenced = plan_fenced(optimizers, self._order, layout, file, self._staging)
        if self.precopy:
            after = self._fences[-1] if self._fences else None
            threading.Thread(target=fenced.precopy, args=(after,), name="deepnvme-fence-precopy",
                             daemon=True).start()
        self._fences.append(fenced)
        self._order = []

        def write(handle: AioHandle, path: str, hash_fn: HashFn | None) -> dict[str, int]:
            return write_fenced(handle, path, fenced, hash_fn)

        def release() -> None:
            fenced.end()
            self._fences.remove(fenced)
            self._copied += fenced.copied_bytes
            self._precopied += fenced.precopied_bytes

        return Staged(layout, write, release)

    def _wait_fences(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if not self._fences:
            return
        start = time.perf_counter()
        if id(optimizer) not in self._order:
            self._order.append(id(optimizer))
        for fenced in list(self._fences):
            fenced.protect(id(optimizer))
        self._fence_wait += time.perf_counter() - start

    def stats(self) -> StagingStats:
        fences = list(self._fences)
        return StagingStats(fence_wait_seconds=self._fence_wait,
                            copied_bytes=self._copied + sum(f.copied_bytes for f in fences),
                            precopied_bytes=self._precopied + sum(f.precopied_bytes for f in fences))

    def close(self) -> None:
        for hook in self._hooks.values():
            hook.remove()
        self._hooks.clear()
        self._staging.close()


def resolve_stager(staging: str | Stager, what: str) -> Stager:
    """The stager for a saver's ``staging`` argument: ``"snapshot"``, ``"fenced"`` (each with its
    default options) or a :class:`Stager` instance (used as given)."""
    if isinstance(staging, Stager):
        return staging
    if staging == "snapshot":
        return SnapshotStager()
    if staging == "fenced":
        return FencedStager()
    raise ValueError(f"{what}: staging must be 'snapshot', 'fenced' or a Stager (SnapshotStager(...), "
                     f"FencedStager(...)), got {staging!r}")
