"""Parameters and gradients in files, brought into memory under a byte budget.

Each tensor (a parameter's data, or its gradient) is an :class:`~._entry.Entry` whose value lives
in one file of a pool-less :class:`~deepnvme.swap.TensorSwapper` (which orders each key's reads
after its writes). A present entry holds a tensor allocated for it; a released parameter's
``.data`` is a one-element placeholder expanded to its shape (NaN for floating types, so a stray
use shows).

Memory bound: ``held`` = present tensors + reads in flight + tensors still being written after
they left their entry + free buffers kept for reuse; every allocation first takes a free buffer of
its size, else makes room (dropping free buffers, evicting unpinned entries, least recently used
first, then waiting for the oldest writes, then for prefetches still in flight) so
``held <= budget``.
Buffer reuse: a tensor's mapping (``nbytes >= MAPPED_MIN``) goes to a free list keyed by ``nbytes``
once its I/O ended and nothing else refers to its storage (use count back to what it was when
mapped), so a step maps, unmaps and page-faults nothing after the first. A gradient
handed over by autograd already exists: room is made for it (as far as what is pinned allows),
then it is counted (:meth:`TensorStore.admit`).
Resident entries: tensors below the offload's ``min_offload_bytes`` (biases, norms) are kept in
memory with their gradients and a backup copy (for a failed update), all in one allocation,
counted in ``held`` for good (3 x their bytes): each would cost a file request per use.
Thread-safety: every public method takes one lock (autograd may run hooks on other threads).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch

from ..config import IOConfig
from ..errors import OffloadMemoryError
from ..io.plan import align_up
from ..io.volume import Volume
from ..memory.heap import MAPPED_MIN, mapped_empty
from ..swap import TensorSwapper
from ._entry import Buffer, Entry

__all__ = ["TensorStore"]

_ALIGN = 64   # bytes between resident tensors in their shared allocation


class TensorStore:
    """The entries of one offloaded model and the budget they share (see the module doc)."""

    def __init__(self, directory: str | os.PathLike[str] | Volume, *, budget: int,
                 config: IOConfig | None) -> None:
        self.budget = int(budget)
        self.swapper = TensorSwapper(directory, config=config, buffer_bytes=1, buffer_count=0,
                                     min_swap_bytes=0)
        self.lock = threading.RLock()
        self.held = 0
        self.peak = 0
        self.bytes_read = 0
        self.bytes_written = 0
        self.prefetch_hits = 0    # fetches served by a read started ahead
        self._ticks = itertools.count(1)
        self._present: dict[int, Entry] = {}          # key -> present entry
        self.by_storage: dict[int, Entry] = {}        # storage address -> present parameter
        # I/O whose tensor left its entry: (future, bytes, its buffer, raise the future's error)
        self._orphans: deque[tuple[Future[Any], int, Buffer | None, bool]] = deque()
        self._free: dict[int, list[Buffer]] = {}    # nbytes -> free buffers (counted in held)
        self.free_bytes = 0
        self.reused = 0       # allocations served by a free buffer
        self.resident_bytes = 0   # counted for resident entries (see make_resident)
        self._resident: list[tuple[Entry, Entry]] = []
        self.kept_gradients: list[Entry] = []   # see keep_gradients
        self.backups: dict[int, torch.Tensor] = {}   # resident key -> room for its old value
        # makes each new buffer of nbytes (a device-trained offload's are page-locked)
        self.new_buffer: Callable[[int], Buffer] = Buffer
        # set by an optimizer that updates in the backward: takes (parameter, gradient), True
        # if it consumed the gradient (then nothing is stored)
        self.on_gradient: Callable[[torch.Tensor, torch.Tensor], bool] | None = None
        self.on_awaited: Callable[[list[torch.Tensor]], None] | None = None   # see set_update_notice

    # --- accounting ----------------------------------------------------------------------

    def _count(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def _reap(self, *, block: bool) -> bool:
        """Forget the oldest finished write (waiting for it with ``block``); raise its error."""
        if not self._orphans or not (block or self._orphans[0][0].done()):
            return False
        fut, nbytes, buf, check = self._orphans.popleft()
        error = fut.exception() if check else None
        del fut   # a read's future holds its tensor: let go before checking the buffer is unshared
        self._give_back(buf, nbytes)
        if error is not None:
            raise error
        return True

    # --- free buffers --------------------------------------------------------------------

    def _give_back(self, buf: Buffer | None, nbytes: int) -> None:
        """``nbytes`` whose I/O ended leave their user: keep the buffer for reuse if unshared."""
        if buf is not None and nbytes >= MAPPED_MIN and buf.unshared():
            self._free.setdefault(nbytes, []).append(buf)
            self.free_bytes += nbytes
        else:
            self.held -= nbytes

    def _free_one(self) -> bool:
        """Unmap one free buffer (any size); False if none."""
        for nbytes, bufs in self._free.items():
            bufs.pop()
            if not bufs:
                del self._free[nbytes]
            self.free_bytes -= nbytes
            self.held -= nbytes
            return True
        return False

    def take_free(self, nbytes: int) -> Buffer | None:
        """A free buffer of ``nbytes`` (it stays counted in ``held``), or None."""
        bufs = self._free.get(nbytes)
        if not bufs:
            return None
        buf = bufs.pop()
        if not bufs:
            del self._free[nbytes]
        self.free_bytes -= nbytes
        self.reused += 1
        return buf

    def _evict_one(self, *, spare_prefetched: bool) -> bool:
        """Drop the least recently used unpinned entry, an awaited one last; a prefetch
        (``spare_prefetched``) spares prefetched and awaited entries."""
        victims = [e for e in self._present.values() if e.pins == 0
                   and (e.read is None or e.read.done())
                   and not (spare_prefetched and (e.prefetched or e.awaited))]
        if not victims:
            return False
        self.drop(min(victims, key=lambda e: (e.awaited, e.tick)))
        return True

    def _wait_prefetch(self) -> bool:
        """Wait for the oldest read still in flight of an unpinned entry (a prefetch), then
        drop it; False if there is none. Its error, if any, comes back on the next fetch."""
        reading = [e for e in self._present.values()
                   if e.pins == 0 and e.read is not None and not e.read.done()]
        if not reading:
            return False
        oldest = min(reading, key=lambda e: e.tick)
        assert oldest.read is not None  # just selected for it; internal invariant
        oldest.read.exception()
        self.drop(oldest)
        return True

    def _room_step(self, *, demand: bool) -> bool:
        """Free some counted memory: a finished write, a free buffer, an LRU entry (a demand
        also waits for the oldest write, then for a prefetch to land). False if nothing could
        be done."""
        return (self._reap(block=False) or self._free_one()
                or self._evict_one(spare_prefetched=not demand)
                or (demand and (self._reap(block=True) or self._wait_prefetch())))

    def _too_big(self, nbytes: int, what: str) -> OffloadMemoryError:
        pinned = sorted(e.name + (".grad" if e.grad else "") for e in self._present.values()
                        if e.pins)
        return OffloadMemoryError(
            f"{what or 'a tensor'} needs {nbytes} bytes but {self.held} of the "
            f"max_in_memory_bytes={self.budget} are held by tensors in use "
            f"({', '.join(pinned[:8])}{' ...' if len(pinned) > 8 else ''}); raise "
            "max_in_memory_bytes or use smaller modules / optimizer sub-groups")

    def make_room(self, nbytes: int, *, demand: bool, what: str = "") -> bool:
        """Get ``held + nbytes`` within the budget. A demand that cannot be met raises
        :class:`OffloadMemoryError`; a prefetch gives up (returns False) instead of evicting
        other prefetched entries or waiting."""
        while self.held + nbytes > self.budget:
            if not self._room_step(demand=demand):
                if not demand:
                    return False
                raise self._too_big(nbytes, what)
        return True

    def buffer(self, nbytes: int, *, demand: bool, what: str = "") -> Buffer | None:
        """A counted buffer of ``nbytes``: a free one (looked for again after each step that
        made room, which may have freed one of this size), else a new mapping once there is
        room; None if a prefetch finds no room, :class:`OffloadMemoryError` if a demand can't."""
        while True:
            if nbytes >= MAPPED_MIN:
                buf = self.take_free(nbytes)
                if buf is not None:
                    return buf
            if self.held + nbytes <= self.budget:
                self._count(nbytes)
                return self.new_buffer(nbytes)
            if not self._room_step(demand=demand):
                if not demand:
                    return None
                raise self._too_big(nbytes, what)

    # --- resident entries ----------------------------------------------------------------

    def make_resident(self, data: Entry, grad: Entry, value: torch.Tensor) -> None:
        """Keep ``data`` (with ``value``, already counted) and its gradient ``grad`` in memory
        for good: no file I/O, never evicted. Counts the gradient and a copy for
        :attr:`backups` too (allocated by :meth:`pack_resident`)."""
        with self.lock:
            self.make_room(2 * data.nbytes, demand=True, what=f"gradient of {grad.name}")
            self._count(2 * data.nbytes)
            data.resident = grad.resident = True
            data.tensor = value
            self._resident.append((data, grad))
            self.resident_bytes += 3 * data.nbytes

    def pack_resident(self) -> None:
        """Move the resident values into one allocation that also holds their gradients and
        backups (call once, after every :meth:`make_resident`). Why one: small tensors that
        live for good, allocated one by one among the megabyte tensors that come and go,
        keep the heap from giving those back to the system."""
        with self.lock:
            sizes = [align_up(d.nbytes, _ALIGN) for d, _ in self._resident]
            arena = torch.empty(3 * sum(sizes), dtype=torch.uint8)
            at = 0
            for (d, g), size in zip(self._resident, sizes):
                views = [arena[at + i * size:at + i * size + e.nbytes].view(e.dtype).view(e.shape)
                         for i, e in enumerate((d, g, d))]   # a shard's gradient has no padding
                at += 3 * size
                assert d.tensor is not None  # make_resident set it; internal invariant
                views[0].copy_(d.tensor)
                d.tensor = views[0]
                d.show(views[0])
                g.tensor = views[1]     # no gradient yet: ``valid`` stays False
                self.backups[d.key] = views[2]

    def keep_gradients(self, grads: list[Entry]) -> None:
        """Keep ``grads`` (gradient entries) in memory for good, in one anonymous mapping outside
        the budget (pages become resident when a backward first writes them): no file I/O, as
        resident entries; valid from the first backward. For ``offload_gradients=False``."""
        if not grads:
            return
        sizes = [align_up(g.nbytes, _ALIGN) for g in grads]
        arena = mapped_empty(sum(sizes))
        at = 0
        for g, size in zip(grads, sizes):
            g.tensor = arena[at:at + g.nbytes].view(g.dtype).view(g.shape)
            g.resident = True
            at += size
        self.kept_gradients = list(grads)

    # --- moving entries ----------------------------------------------------------------

    def store(self, entry: Entry, tensor: torch.Tensor, *, keep: bool,
              buf: Buffer | None = None) -> None:
        """Start writing ``tensor`` (already counted in ``held``) as ``entry``'s value. With
        ``keep`` it is the entry's present tensor and stays (unchanged until the write ends);
        else it leaves memory once written (``buf``, the free buffer it is in, is then reused),
        waiting for writes while over the budget. Not for resident entries."""
        assert not entry.resident  # callers keep resident values in memory; internal invariant
        data = tensor.detach()
        if not data.is_contiguous():
            data = data.contiguous()
        entry.write = self.swapper.swap_out(entry.key, data)
        self.bytes_written += entry.nbytes
        if keep:
            return
        if entry.tensor is not None:
            self._present.pop(entry.key, None)
            buf = entry.buf if entry.tensor.data_ptr() == data.data_ptr() else None
            entry.tensor, entry.read, entry.prefetched, entry.buf = None, None, False, None
        del tensor, data
        self._orphans.append((entry.write, entry.nbytes, buf, True))
        self.settle()

    def settle(self) -> None:
        """After memory arrived uncounted-for (a gradient from autograd): get back within the
        budget by evicting and waiting for writes, as far as that goes."""
        while self.held > self.budget and self._room_step(demand=True):
            pass

    def count(self, nbytes: int) -> None:
        """Count ``nbytes`` that arrived from outside (a gradient handed over by autograd)."""
        self._count(nbytes)

    def admit(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` that exist outside the store (autograd's gradient, a user's
        parameter until written), making room for them first as far as that goes: ``held``
        exceeds the budget only while everything present is pinned or in use."""
        with self.lock:
            try:
                self.make_room(nbytes, demand=True, what=what)
            except OffloadMemoryError:   # over the budget until writes end (see settle)
                pass
            self._count(nbytes)

    def uncount(self, nbytes: int) -> None:
        self.held -= nbytes

    def drop(self, entry: Entry) -> None:
        """Forget the present value (a parameter gets its placeholder back); a resident
        entry keeps it."""
        if entry.tensor is None or entry.resident:
            return
        self._present.pop(entry.key, None)
        if not entry.grad:
            self.by_storage.pop(entry.tensor.untyped_storage().data_ptr(), None)
            entry.hide()
        buf, read = entry.buf, entry.read
        entry.tensor, entry.read, entry.prefetched, entry.buf = None, None, False, None
        entry.awaited = False
        if read is not None and not read.done():   # a prefetch still lands in the buffer
            self._orphans.append((read, entry.nbytes, buf, False))
            return
        del read   # its result is the tensor: let go before checking the buffer is unshared
        if entry.write is not None and not entry.write.done():
            self._orphans.append((entry.write, entry.nbytes, buf, True))  # the write reads it
        else:
            self._give_back(buf, entry.nbytes)

    def _start_read(self, entry: Entry, buf: Buffer) -> None:
        out = buf.typed(entry.dtype, entry.shape)
        entry.tensor, entry.buf = out, (buf if entry.nbytes >= MAPPED_MIN else None)
        entry.read = self.swapper.swap_in(entry.key, out=out)
        entry.tick = next(self._ticks)
        self._present[entry.key] = entry
        if not entry.grad:
            self.by_storage[out.untyped_storage().data_ptr()] = entry
        self.bytes_read += entry.nbytes

    def prefetch(self, entries: Iterable[Entry]) -> None:
        """Start reading entries not present, while the budget has room without waiting."""
        with self.lock:
            for e in entries:
                if e.tensor is None and e.valid:
                    buf = self.buffer(e.nbytes, demand=False)
                    if buf is None:
                        continue
                    self._start_read(e, buf)
                    e.prefetched = True

    def fetch(self, entries: list[Entry], what: str) -> None:
        """Make ``entries`` present and pin them (parameters get their data back); blocks on
        the reads. Raises :class:`OffloadMemoryError` (pinning nothing) if they cannot fit."""
        with self.lock:
            pinned: list[Entry] = []
            try:
                for e in entries:
                    e.pins += 1
                    pinned.append(e)
                    if e.tensor is None:
                        buf = self.buffer(e.nbytes, demand=True, what=f"{what} ({e.name})")
                        assert buf is not None  # a demand gets one or raises
                        self._start_read(e, buf)
                    elif e.prefetched:
                        self.prefetch_hits += 1
                    e.tick = next(self._ticks)
                    e.prefetched = False
                for e in entries:
                    if e.read is not None:
                        e.read.result()
                        e.read = None
                    if not e.grad:
                        assert e.tensor is not None  # made present above; internal invariant
                        e.show(e.tensor)
            except BaseException:
                self.unpin(pinned)
                raise

    # --- ranges of an entry's file (an optimizer update in slices) -------------------------

    def read_range(self, entry: Entry, start: int, stop: int, *, demand: bool,
                   what: str = "") -> tuple[torch.Tensor, Buffer, Future[torch.Tensor]] | None:
        """Start reading elements ``start..stop`` of ``entry``'s file (flattened) into a
        counted buffer: ``(1-D tensor, its buffer, the read)``; None if a prefetch finds no
        room. Give the buffer back with :meth:`release_range`."""
        with self.lock:
            item = entry.dtype.itemsize
            nbytes = (stop - start) * item
            buf = self.buffer(nbytes, demand=demand, what=what)
            if buf is None:
                return None
            out = buf.raw[:nbytes].view(entry.dtype)
            fut = self.swapper.swap_in_range(entry.key, out, start * item)
            self.bytes_read += nbytes
            return out, buf, fut

    def write_range(self, entry: Entry, tensor: torch.Tensor, start: int) -> Future[None]:
        """Start writing ``tensor`` (1-D) as elements from ``start`` of ``entry``'s file."""
        with self.lock:
            fut = self.swapper.swap_out_range(entry.key, tensor, start * entry.dtype.itemsize)
            self.bytes_written += tensor.numel() * tensor.element_size()
            return fut

    def release_range(self, buf: Buffer, nbytes: int, io: Future[Any] | None = None) -> None:
        """A range's buffer is no longer used (drop every view of it first): back to the free
        buffers now, or once ``io`` (a write from it, a read into it) ended."""
        with self.lock:
            if io is not None and not io.done():
                self._orphans.append((io, nbytes, buf, False))
                return
            self._give_back(buf, nbytes)

    def unpin(self, entries: Iterable[Entry]) -> None:
        with self.lock:
            for e in entries:
                e.pins -= 1

    def wait_writes(self) -> None:
        """Block until every write finished; raise the first failure."""
        with self.lock:
            while self._reap(block=True):
                pass
            self.swapper.wait()

    def close(self) -> None:
        with self.lock:
            self.swapper.close()
            for g in self.kept_gradients:   # their mapping goes back to the system
                g.tensor, g.valid = None, False
            self.kept_gradients = []
