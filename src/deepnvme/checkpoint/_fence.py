"""Fenced saves: write from the live tensors; at the fence, copy what is not written yet.

A fenced save (:class:`~._staging.FencedStager`, ``CheckpointManager(staging="fenced")``) writes
each large storage straight from the live tensor. :class:`FencedWrite` tracks every such storage
(waiting, in flight, done) under one lock shared by the writer thread and the training thread.
When an optimizer's ``step()`` is about to change tensors, its step pre-hook calls
:meth:`FencedWrite.protect`: every storage not done yet that this optimizer changes, or that no
fenced optimizer owns, is copied into staging memory and the step goes on at once; the writer
writes those from their copies. A storage in flight at the fence (being written or hashed from
live memory) is copied too and written and hashed again from its copy once the first pass ends,
so bytes the step tears never stay in the file. Storages under 256 KiB are gathered into regions
copied when the save starts (:func:`~deepnvme.checkpoint.saver.gather_small`) and never read
live later.

Staging (:class:`Staging`): one page-locked arena (an :class:`~._arena.ArenaPool` of one)
reused by every save, allocated at the first
fence that copies, of ``min(budget, sum of the save's large storages each rounded up to 4096)``
bytes (``budget=None``: no cap, so never more than the save itself; ``budget=0``: never copy,
the step waits for the write). When the arena cannot hold everything to protect, the fence
copies the storages the writer would reach last and waits for the others to be written; when
an earlier save still writes from the arena, the fence first waits for that save. Both are
logged at debug level. The unit is a whole storage: a large tensor half written at the fence
is copied whole. With :meth:`FencedWrite.precopy` on a background thread, the copies start at
``save()`` (from the end of the write order, while the writer writes from its start), so the
fence finds less to copy; that costs memory bandwidth during forward and backward.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..handles.aio import AioHandle
from ..io import durable
from ..io.plan import align_up
from ..memory.copy import ParallelCopy, copy_bytes
from ..memory.views import byte_view, storage_bytes
from ._arena import ALIGN, ArenaPool, Lease
from .saver import StorageLayout, gather_small

__all__ = ["Entry", "FencedWrite", "Staging", "plan_fenced", "write_fenced", "optimizer_storages"]

log = logging.getLogger(__name__)

WAITING, IN_FLIGHT, DONE = 0, 1, 2
_ALIGN = ALIGN
_BATCH = 32 << 20
"""Bytes per write request of small-enough storages (a larger storage is a request alone): a
storage in flight at the fence is written twice, so requests stay small."""


@dataclass(eq=False)
class Entry:
    """One large storage of a fenced save: where it goes, who changes it, and its state."""

    key: str  # the storage record's key
    storage: torch.UntypedStorage
    offset: int  # file offset of its record
    owner: int | None  # id() of the fenced optimizer that changes it, None for no such optimizer
    copy: torch.Tensor | None = None  # its bytes at save() time once the fence copied them
    state: int = WAITING
    torn: bool = False  # copied while in flight: written and hashed again from the copy
    copying: bool = False  # being copied by the background precopy (the writer leaves it)
    checksum: int | None = None

    def source(self) -> torch.Tensor:
        return self.copy if self.copy is not None else storage_bytes(self.storage)


class Staging:
    """The reused locked arena of copy-on-fence, held by one :class:`FencedWrite` at a time
    (module docstring: size formula), drawn from an :class:`~._arena.ArenaPool` of one arena.
    Thread-safe."""

    def __init__(self, budget: int | None, pool: ArenaPool | None = None) -> None:
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"FencedStager: staging_bytes must be None or an int >= 0, got {budget!r}")
        self.budget = budget
        self._pool = pool if pool is not None else ArenaPool(1)
        self._holder: object | None = None  # a FencedWrite, or a multi-rank ShareFence
        self._lease: Lease | None = None
        self._lock = threading.Lock()  # guards _holder and _lease
        self._taking = threading.Lock()  # one save at a time waits for the pool

    def _held_by(self, holder: object) -> torch.Tensor | None:
        with self._lock:
            return self._lease.tensor if self._holder is holder and self._lease is not None else None

    def acquire(self, holder: object, need: int) -> torch.Tensor | None:
        """The arena for ``holder`` (at most ``budget`` bytes; None when the budget is 0), waiting
        while an earlier save holds it."""
        cap = need if self.budget is None else min(need, self.budget)
        if cap <= 0:
            return None
        if (arena := self._held_by(holder)) is not None:
            return arena
        with self._taking:
            if (arena := self._held_by(holder)) is not None:
                return arena
            if self._pool.busy():
                log.debug("deepnvme.CheckpointManager: the fence waits for an earlier save to free "
                          "the staging arena")
            lease = self._pool.take(cap)
            with self._lock:
                self._holder, self._lease = holder, lease
            return lease.tensor

    def release(self, holder: object) -> None:
        with self._lock:
            if self._holder is not holder or self._lease is None:
                return
            lease, self._holder, self._lease = self._lease, None, None
        lease.release()

    def close(self) -> None:
        self._pool.close()


def optimizer_storages(optimizer: Any) -> list[torch.UntypedStorage]:
    """The storages ``optimizer.step()`` changes: its parameters and its state's tensors."""
    out = [p.untyped_storage() for group in optimizer.param_groups for p in group["params"]]
    for state in optimizer.state.values():
        out.extend(v.untyped_storage() for v in state.values() if isinstance(v, torch.Tensor))
    return out


class FencedWrite:
    """The large storages of one fenced save, in write order, and the small regions already
    copied (``(region, file offset, {key: (start, end) in region})``). Thread-safe."""

    def __init__(self, entries: list[Entry], small: list[tuple[torch.Tensor, int, dict[str, tuple[int, int]]]],
                 staging: Staging) -> None:
        self.entries = entries
        self.small = small
        self.staged = 0  # arena bytes in use by this save's copies
        self.copied_bytes = 0  # copied by the fence (the training thread waits for these)
        self.precopied_bytes = 0  # copied in the background before the fence (:meth:`precopy`)
        self._staging = staging
        self._cond = threading.Condition()
        self._ended = False
        self._fenced = False

    # ---- writer side ----------------------------------------------------------------------

    def take(self) -> list[tuple[Entry, torch.Tensor]]:
        """The next request: waiting entries in order (up to 32 MiB, or one larger storage), now
        in flight, with the memory to write each from. Empty when none waits."""
        batch: list[tuple[Entry, torch.Tensor]] = []
        total = 0
        with self._cond:
            while True:
                for e in self.entries:
                    if e.state != WAITING or e.copying:
                        continue
                    n = e.storage.nbytes()
                    if batch and total + n > _BATCH:
                        break
                    e.state = IN_FLIGHT
                    batch.append((e, e.source()))
                    total += n
                if batch or not any(e.copying for e in self.entries):
                    return batch
                self._cond.wait()  # only storages being precopied are left

    def finish(self, batch: list[tuple[Entry, torch.Tensor]], sums: dict[str, int]) -> None:
        """Entries of ``batch`` are written (and hashed: ``sums``); torn ones wait again."""
        with self._cond:
            for e, _ in batch:
                if e.torn:
                    e.torn, e.state = False, WAITING
                else:
                    e.state, e.checksum = DONE, sums.get(e.key)
            self._cond.notify_all()

    def end(self) -> None:
        """The save is over (written or failed): wake fences, give the arena back."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()
            while any(e.copying for e in self.entries):  # the arena stays ours until they end
                self._cond.wait()
        self._staging.release(self)

    def wait_ended(self) -> None:
        with self._cond:
            while not self._ended:
                self._cond.wait()

    def _acquire(self, need: int) -> torch.Tensor | None:
        """The staging arena for this save (None: budget 0, or the save ended meanwhile)."""
        arena = self._staging.acquire(self, need)
        with self._cond:
            ended = self._ended
        if ended:  # end() ran before acquire() returned: nobody else would give it back
            self._staging.release(self)
            return None
        return arena

    def precopy(self, after: FencedWrite | None) -> None:
        """Background, from ``save()`` until the fence: copy waiting storages into the staging
        arena one at a time, from the end of the write order, so the fence has less to copy.
        Starts once ``after`` (the previous fenced save) has ended, so the arena goes to saves
        in order and an earlier save's fence never waits for a later save."""
        if after is not None:
            after.wait_ended()
        with self._cond:
            if self._ended or self._fenced:
                return
            need = sum(align_up(e.storage.nbytes(), _ALIGN) for e in self.entries)
        arena = self._acquire(need)
        try:
            while arena is not None:
                with self._cond:
                    e = next((e for e in reversed(self.entries) if e.state == WAITING and e.copy is None
                              and not e.copying), None)
                    if self._ended or self._fenced or e is None:
                        return
                    n = e.storage.nbytes()
                    if align_up(n, _ALIGN) > arena.numel() - self.staged:
                        return
                    dst = arena[self.staged:self.staged + n]
                    self.staged += align_up(n, _ALIGN)
                    e.copying = True
                done = False
                try:
                    if n:
                        copy_bytes([(dst, storage_bytes(e.storage))])
                    done = True
                finally:
                    with self._cond:
                        e.copying = False
                        if done:
                            e.copy = dst
                            self.precopied_bytes += n
                        self._cond.notify_all()
        finally:
            with self._cond:
                ended = self._ended
            if ended:  # end() may have run before acquire() returned
                self._staging.release(self)

    # ---- training-thread side -------------------------------------------------------------

    def protect(self, owner: int) -> None:
        """Make the save independent of the storages optimizer ``owner`` changes (and of those
        no fenced optimizer owns): copy them, or wait until they are written. Blocks."""
        def todo() -> list[Entry]:
            return [e for e in self.entries if e.state != DONE and e.copy is None
                    and (e.owner is None or e.owner == owner)]

        with self._cond:
            self._fenced = True  # no new precopy starts; one in progress is waited for
            while any(e.copying for e in self.entries):
                self._cond.wait()
            if self._ended or not todo():
                return
            need = sum(align_up(e.storage.nbytes(), _ALIGN) for e in self.entries)
        arena = self._acquire(need)  # may wait for an earlier save: not under our lock
        with self._cond:
            left = todo()
            room = 0 if arena is None else arena.numel() - self.staged
            copy, chosen = ParallelCopy(), []
            for e in reversed(left):  # the writer reaches these last
                n = e.storage.nbytes()
                if arena is None or align_up(n, _ALIGN) > room:
                    break
                e.copy = arena[self.staged:self.staged + n]
                if n:
                    copy.add(e.copy, storage_bytes(e.storage))
                e.torn = e.state == IN_FLIGHT
                self.staged += align_up(n, _ALIGN)
                room -= align_up(n, _ALIGN)
                chosen.append(e)
            copy.finish()
            self.copied_bytes += sum(e.storage.nbytes() for e in chosen)
            rest = [e for e in left if e.copy is None]
            if rest:
                log.debug("deepnvme.CheckpointManager: fence staging (%s bytes) holds %d of %d storages "
                          "to protect; the step waits for the other %d to be written",
                          self._staging.budget, len(chosen), len(left), len(rest))
            while rest and not self._ended and any(e.state != DONE for e in rest):
                self._cond.wait()


def plan_fenced(optimizers: list[Any], fenced_first: list[int], layout: StorageLayout, file: str,
                staging: Staging) -> FencedWrite:
    """One save's :class:`FencedWrite`: large storages in write order (those of the optimizers
    in ``fenced_first`` order (``id()`` s of those that fenced first at the previous save), then
    the other optimizers', then unowned ones; file order within each), small ones copied now."""
    ranked = sorted(optimizers, key=lambda o: (fenced_first.index(id(o)) if id(o) in fenced_first
                                               else len(fenced_first)))
    owners: dict[int, int] = {}
    for opt in ranked:
        for st in optimizer_storages(opt):
            owners.setdefault(st._cdata, id(opt))
    rank = {id(o): i for i, o in enumerate(ranked)}
    large, regions = gather_small(file, layout)
    entries = [Entry(key=k, storage=layout.items[k][0], offset=layout.items[k][1].offset,
                     owner=owners.get(layout.items[k][0]._cdata)) for k in large]
    entries.sort(key=lambda e: (len(rank) if e.owner is None else rank[e.owner], e.offset))
    small = [(region, start, {k: (layout.items[k][1].offset - start, layout.items[k][1].end - start)
                              for k in keys}) for region, start, keys in regions]
    return FencedWrite(entries, small, staging)


def write_fenced(handle: AioHandle, file: str, fw: FencedWrite,
                 hash_fn: Callable[[Any], int] | None) -> dict[str, int]:
    """Write ``fw`` into ``file`` (regions, then entries as :meth:`FencedWrite.take` hands them
    out, hashing each request while it is written), fsync; each storage key's checksum."""
    sums: dict[str, int] = {}
    pending = handle.write_many(file, [(region, start) for region, start, _ in fw.small])
    if hash_fn is not None:
        for region, _, spans in fw.small:
            sums.update({k: hash_fn(byte_view(region[a:b])) for k, (a, b) in spans.items()})
    pending.result()
    while batch := fw.take():
        pending = handle.write_many(file, [(src, e.offset) for e, src in batch])
        got = {} if hash_fn is None else {e.key: hash_fn(byte_view(src)) for e, src in batch}
        pending.result()
        fw.finish(batch, got)
    durable.fsync_path(file)
    sums.update({e.key: e.checksum for e in fw.entries if e.checksum is not None})
    return sums
