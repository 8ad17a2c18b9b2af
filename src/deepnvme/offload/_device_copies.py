"""Device copies of offloaded parameters: read into host buffers, copied to the device ahead
of use, kept while there is room, their memory reused under a byte budget.

A parameter becomes present on the device in two steps: its file is read into a host buffer of
the store (page-locked), then copied to a device buffer on the side stream. The host value stays
pinned in the store until that copy's event is done (so the buffer is neither evicted nor reused
under the copy); the compute stream waits for the event before a module uses the parameter. The
model's parameter holds the device tensor from its first use until its copy is evicted, then a
device placeholder. Resident (small) parameters keep a device copy for good.

Memory bound (device): ``budget`` bytes of parameter buffers (present copies, copies in flight
and free buffers kept for reuse); every allocation takes a free buffer of its size, else makes
room by evicting copies nobody uses (unpinned, their storage unshared: autograd holds no view),
least recently used first, then by freeing buffers of other sizes. Resident copies are outside
it. A buffer is reused only after the compute stream's work queued when it was let go (an event
orders the next copy into it after that work).
Thread-safety: every public method runs under the store's lock.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable
from typing import Any

import torch

from ..errors import OffloadMemoryError
from ._device import ComputeDevice
from ._entry import Entry
from ._store import TensorStore

__all__ = ["DeviceCopies", "DeviceCopy"]


def _use_count(t: torch.Tensor) -> int:
    return int(torch._C._storage_Use_Count(t.untyped_storage()._cdata))


class DeviceCopy:
    """One parameter's value on the device (a typed view of its own uint8 buffer)."""

    __slots__ = ("entry", "raw", "tensor", "event", "host_pinned", "pins", "tick", "prefetched",
                 "alone", "attached", "resident")

    def __init__(self, entry: Entry, raw: torch.Tensor) -> None:
        self.entry = entry
        self.raw = raw
        self.tensor = raw.view(entry.dtype).view(entry.shape)
        self.alone = _use_count(raw)   # raw and tensor: nobody else uses the buffer
        self.event: Any = None         # the copy to the device, until known done
        self.host_pinned = False       # the store's host value is pinned for the copy
        self.pins = 0
        self.tick = 0
        self.prefetched = False
        self.attached = False          # the model's parameter holds ``tensor``
        self.resident = False


class DeviceCopies:
    """The device copies of one offloaded model (see the module doc)."""

    def __init__(self, store: TensorStore, device: ComputeDevice,
                 params: dict[int, torch.nn.Parameter]) -> None:
        self.store = store
        self.device = device
        self.params = params            # entry key -> the model's parameter
        self.budget = 0                 # set once the units are known
        self.held = 0
        self.peak = 0
        self.resident_bytes = 0
        self.bytes_copied = 0
        self.prefetch_hits = 0          # copies a prefetch had started before they were needed
        self.present: dict[int, DeviceCopy] = {}       # entry key -> copy
        self.by_storage: dict[int, DeviceCopy] = {}    # device buffer address -> copy
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}   # nbytes -> (buffer, mark)
        self._copying: deque[DeviceCopy] = deque()     # copies in issue order, events pending
        self._ticks = itertools.count(1)

    # --- the users' side ---------------------------------------------------------------

    def acquire(self, entries: list[Entry], what: str) -> None:
        """Make ``entries`` present on the device and pin them; the model's parameters hold
        the device tensors and the compute stream waits for their copies. Blocks on file
        reads only (the copies run on the side stream)."""
        with self.store.lock:
            self.poll()
            pinned: list[DeviceCopy] = []
            try:
                for e in entries:      # pinned first: making room must not evict them
                    if e.key in self.present:
                        self.present[e.key].pins += 1
                        pinned.append(self.present[e.key])
                missing = [e for e in entries if e.key not in self.present]
                if missing:
                    self._fetch_host(missing, what)
                    try:
                        for e in missing:
                            got = self._take(e.nbytes, demand=True, what=f"{what} ({e.name})")
                            assert got is not None  # a demand gets one or raises
                            self._issue(e, *got)
                            self.present[e.key].pins += 1
                            pinned.append(self.present[e.key])
                    except BaseException:   # copies issued unpin their host values when done
                        self.store.unpin([e for e in missing if e.key not in self.present])
                        raise
            except BaseException:
                for c in pinned:
                    c.pins -= 1
                raise
            for c in pinned:
                c.tick = next(self._ticks)
                if c.prefetched:
                    self.prefetch_hits += 1
                    c.prefetched = False
                if not self.device.done(c.event):
                    self.device.compute_wait(c.event)
                if not c.attached:
                    self.params[c.entry.key].data = c.tensor
                    c.attached = True

    def tensor(self, entry: Entry) -> torch.Tensor:
        """The device tensor of ``entry`` (acquired)."""
        return self.present[entry.key].tensor

    def release(self, entries: Iterable[Entry]) -> None:
        with self.store.lock:
            for e in entries:
                self.present[e.key].pins -= 1

    def prefetch(self, entries: Iterable[Entry]) -> None:
        """Start reading ``entries`` not on the device, and copying those whose reads ended,
        while the budgets have room without waiting (best effort, in order)."""
        with self.store.lock:
            self.poll()
            entries = list(entries)
            for e in entries:       # present already: wanted soon, so not the next to evict
                c = self.present.get(e.key)
                if c is not None and c.pins == 0 and not c.resident:
                    c.tick = next(self._ticks)
                    c.prefetched = True
            missing = [e for e in entries if e.key not in self.present and e.valid]
            self.store.prefetch(missing)
            for e in missing:
                read = e.read
                if e.tensor is None or (read is not None and (not read.done()
                                                              or read.exception() is not None)):
                    continue   # still reading (or failed: the fetch that needs it raises)
                got = self._take(e.nbytes, demand=False)
                if got is None:
                    break
                self.store.fetch([e], f"prefetching {e.name}")   # read done: pins, no wait
                self._issue(e, *got)
                self.present[e.key].prefetched = True

    def make_resident(self, entry: Entry) -> None:
        """Keep ``entry`` (a resident parameter, present in the store for good) on the device
        for good, outside the budget."""
        with self.store.lock:
            raw = self.device.empty(entry.nbytes)
            self.resident_bytes += entry.nbytes
            self._issue(entry, raw, None, pin_host=False)
            c = self.present[entry.key]
            c.resident = True
            c.pins += 1
            self.params[entry.key].data = c.tensor
            c.attached = True

    def refresh(self, entry: Entry) -> None:
        """Copy a resident parameter's host value (just updated) to its device copy again."""
        with self.store.lock:
            c = self.present[entry.key]
            assert entry.tensor is not None  # resident: present for good; internal invariant
            c.event = self.device.to_device(c.tensor, entry.tensor, after=self.device.compute_mark())
            self._copying.append(c)
            self.bytes_copied += entry.nbytes

    def forget(self, entries: Iterable[Entry]) -> None:
        """Drop the device copies of ``entries`` (not resident ones): their host values are
        about to change. A copy still in use elsewhere leaves the pool to its users."""
        with self.store.lock:
            for e in entries:
                c = self.present.get(e.key)
                if c is not None and not c.resident:
                    self._evict(c, force=True)

    # --- completion --------------------------------------------------------------------

    def poll(self) -> None:
        """Let go of the host values of copies that ended (in issue order)."""
        while self._copying and self.device.done(self._copying[0].event):
            self._finished(self._copying.popleft())

    def settle(self) -> None:
        """Wait for every copy in flight and let go of their host values."""
        with self.store.lock:
            while self._copying:
                c = self._copying.popleft()
                self.device.synchronize(c.event)
                self._finished(c)

    def _finished(self, c: DeviceCopy) -> None:
        c.event = None
        if c.host_pinned:
            c.host_pinned = False
            self.store.unpin([c.entry])

    def _fetch_host(self, entries: list[Entry], what: str) -> None:
        """Host values pinned in the store; if its budget is held by copies in flight, wait
        for them and try again."""
        try:
            self.store.fetch(entries, what)
        except OffloadMemoryError:
            if not self._copying:
                raise
            self.settle()
            self.store.fetch(entries, what)

    # --- buffers -----------------------------------------------------------------------

    def _issue(self, e: Entry, raw: torch.Tensor, after: Any, *, pin_host: bool = True) -> None:
        c = DeviceCopy(e, raw)
        assert e.tensor is not None  # fetched (pinned) by the caller; internal invariant
        c.event = self.device.to_device(c.tensor, e.tensor, after=after)
        c.host_pinned = pin_host     # resident host values never leave: nothing to unpin
        c.tick = next(self._ticks)
        self._copying.append(c)
        self.present[e.key] = c
        self.by_storage[raw.untyped_storage().data_ptr()] = c
        self.bytes_copied += e.nbytes

    def _take(self, nbytes: int, *, demand: bool,
              what: str = "") -> tuple[torch.Tensor, Any] | None:
        """A counted device buffer of ``nbytes`` and the event to order a copy into it after;
        None if a prefetch finds no room, :class:`OffloadMemoryError` if a demand can't."""
        while True:
            bufs = self._free.get(nbytes)
            if bufs:
                got = bufs.pop()
                if not bufs:
                    del self._free[nbytes]
                return got
            if self.held + nbytes <= self.budget:
                self.held += nbytes
                self.peak = max(self.peak, self.held)
                return self.device.empty(nbytes), self.device.compute_mark()
            if not self._room_step(demand=demand):
                if not demand:
                    return None
                raise self._too_big(nbytes, what)

    def _room_step(self, *, demand: bool) -> bool:
        victims = [c for c in self.present.values() if c.pins == 0 and not c.resident
                   and (demand or (not c.prefetched and self.device.done(c.event)))
                   and self._unshared(c)]
        if victims:
            self._evict(min(victims, key=lambda c: c.tick), force=False)
            return True
        for nbytes, bufs in self._free.items():   # a free buffer of another size
            bufs.pop()
            if not bufs:
                del self._free[nbytes]
            self.held -= nbytes
            return True
        return False

    def _unshared(self, c: DeviceCopy) -> bool:
        return _use_count(c.raw) == c.alone + (1 if c.attached else 0)

    def _evict(self, c: DeviceCopy, *, force: bool) -> None:
        if c.event is not None:            # still copying in (so in _copying): let it land
            self.device.synchronize(c.event)
            self._copying.remove(c)
            self._finished(c)
        if c.attached:
            self.params[c.entry.key].data = self.device.placeholder(c.entry.shape, c.entry.dtype)
            c.attached = False
        del self.present[c.entry.key]
        del self.by_storage[c.raw.untyped_storage().data_ptr()]
        nbytes = c.entry.nbytes
        if force and not self._unshared(c):
            self.held -= nbytes            # its users keep it; torch frees it after them
            return
        self._free.setdefault(nbytes, []).append((c.raw, self.device.compute_mark()))

    def _too_big(self, nbytes: int, what: str) -> OffloadMemoryError:
        pinned = sorted(c.entry.name for c in self.present.values() if c.pins and not c.resident)
        return OffloadMemoryError(
            f"{what or 'a parameter'} needs {nbytes} bytes on {self.device.device} but "
            f"{self.held} of the max_device_bytes={self.budget} are held by parameters in use "
            f"({', '.join(pinned[:8])}{' ...' if len(pinned) > 8 else ''}); raise "
            "max_device_bytes or use smaller modules")

    def close(self) -> None:
        """Wait for the copies in flight; forget every copy and buffer (the parameters keep
        whatever device tensor they hold)."""
        with self.store.lock:
            for c in self._copying:
                self.device.synchronize(c.event)
            self._copying.clear()
            self.present.clear()
            self.by_storage.clear()
            self._free.clear()
            self.held = 0
