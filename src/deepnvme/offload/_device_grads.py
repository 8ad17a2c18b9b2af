"""Gradients produced on the device, copied back into the store while the backward goes on.

Each gradient autograd hands over is copied device->host on the side stream into a buffer of the
store (page-locked), after the compute work that produced it. The host side (written to its file
as the first gradient since ``zero_grad``, added to the stored one, or kept for a resident
parameter, exactly as the CPU path does) runs once the copy's event is done: polled at each hook,
and for all of them at the end of the backward (autograd's final callback), before a forward,
an optimizer update, ``zero_grad`` or a read of a gradient.

Memory bound: at most ``cap`` bytes of gradients in flight (host buffers counted in the store's
budget; autograd's device tensors are kept alive until their copies end): the oldest is waited
for when another would pass it. The offload keeps ``cap`` to a quarter of the store's budget, so
finishing one (which may read the stored gradient to add to it) finds room beside the others.
Thread-safety: every method runs under the store's lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ..errors import OffloadMemoryError
from ._device import ComputeDevice
from ._entry import Buffer, Entry
from ._store import TensorStore

__all__ = ["DeviceGradients"]


class _InFlight:
    __slots__ = ("entry", "buf", "host", "source", "event")

    def __init__(self, entry: Entry, buf: Buffer, host: torch.Tensor, source: torch.Tensor,
                 event: Any) -> None:
        self.entry, self.buf, self.host, self.source, self.event = entry, buf, host, source, event


class DeviceGradients:
    """The gradients of one offloaded model on their way from the device (see the module doc)."""

    def __init__(self, store: TensorStore, device: ComputeDevice, *, cap: int,
                 relieve: Callable[[], None]) -> None:
        self.store = store
        self.device = device
        self.cap = cap
        self.relieve = relieve         # frees host memory held for other copies in flight
        self.bytes_copied = 0
        self._flight: deque[_InFlight] = deque()
        self._bytes = 0
        self._queued_for = -1          # the backward (graph task) whose end drains

    def take(self, entry: Entry, grad: torch.Tensor) -> None:
        """Start copying ``grad`` (autograd's, on the device) back for ``entry`` (a gradient
        entry); the host side runs once the copy ended."""
        store = self.store
        with store.lock:
            self.poll()
            if any(f.entry is entry for f in self._flight):
                self.drain()           # the same parameter again: keep the order of additions
            while self._flight and self._bytes + entry.nbytes > self.cap:
                self._complete(self._flight.popleft(), wait=True)
            buf = self._buffer(entry)
            host = buf.typed(entry.dtype, entry.shape)
            event = self.device.to_host(host, grad.detach())
            self._flight.append(_InFlight(entry, buf, host, grad, event))
            self._bytes += entry.nbytes
            self.bytes_copied += entry.nbytes
            self._queue_final_callback()

    def _buffer(self, entry: Entry) -> Buffer:
        what = f"gradient of {entry.name}"
        try:
            buf = self.store.buffer(entry.nbytes, demand=True, what=what)
        except OffloadMemoryError:
            self.drain()               # buffers of gradients in flight: their writes free them
            self.relieve()
            buf = self.store.buffer(entry.nbytes, demand=True, what=what)
        assert buf is not None  # a demand gets one or raises; internal invariant
        return buf

    def _queue_final_callback(self) -> None:
        """Drain at the end of the running backward (once per backward)."""
        task = torch._C._current_graph_task_id()
        if task < 0 or task == self._queued_for:
            return
        torch.autograd.Variable._execution_engine.queue_callback(self.drain)
        self._queued_for = task

    def poll(self) -> None:
        """Finish the gradients whose copies ended (in order)."""
        with self.store.lock:
            while self._flight and self.device.done(self._flight[0].event):
                self._complete(self._flight.popleft(), wait=False)

    def drain(self) -> None:
        """Finish every gradient in flight (waits for their copies); raise the first error."""
        with self.store.lock:
            while self._flight:
                self._complete(self._flight.popleft(), wait=True)

    def abandon(self) -> None:
        """Wait for the copies in flight and forget them (the offload closes)."""
        with self.store.lock:
            while self._flight:
                f = self._flight.popleft()
                self.device.synchronize(f.event)
                self.store.uncount(f.entry.nbytes)
            self._bytes = 0

    def _complete(self, f: _InFlight, *, wait: bool) -> None:
        self._bytes -= f.entry.nbytes
        store, entry = self.store, f.entry
        try:
            if wait:
                self.device.synchronize(f.event)
        except BaseException:
            store.uncount(entry.nbytes)
            raise
        del f.source                        # autograd's device tensor may go now
        if not entry.resident and not entry.valid:   # the first since zero_grad: written as is
            store.store(entry, f.host, keep=False, buf=f.buf)
            entry.valid = True
            return
        try:
            if entry.resident:              # kept in memory (a small parameter's, or all kept)
                assert entry.tensor is not None  # allocated at setup; internal invariant
                if entry.valid:
                    entry.tensor += f.host  # what AccumulateGrad does: param.grad += grad
                else:
                    entry.tensor.copy_(f.host)
                entry.valid = True
                return
            try:
                store.fetch([entry], f"gradient of {entry.name}")
            except OffloadMemoryError:
                self.relieve()
                store.fetch([entry], f"gradient of {entry.name}")
            try:
                assert entry.tensor is not None  # fetch made it present; internal invariant
                entry.tensor += f.host
            finally:
                store.unpin([entry])
            store.store(entry, entry.tensor, keep=False)
        finally:
            store.uncount(entry.nbytes)     # the copy's buffer (freed with ``f``)
