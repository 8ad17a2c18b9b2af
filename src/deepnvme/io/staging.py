"""Device tensors <-> files through a small ring of pinned staging buffers, pipelined.

A request is cut into chunks of at most ``chunk_bytes``. With ``buffers`` (K >= 2) staging
buffers, a write copies chunk i+1 device->host while chunks i-K+2..i are written by the engine;
a read copies chunk i host->device while chunks i+1..i+K-1 are read. So the device copy hides
behind storage I/O, and pinned memory is bounded by ``drivers x buffers x (chunk_bytes +
alignment)`` bytes per pipeline (allocated on first use, freed by :meth:`StagingPipeline.close`).

Chunk boundaries fall on ``alignment`` multiples of the *file* offset and each chunk sits in its
staging buffer at the same address residue as its file offset, so only the first and last chunk
of an unaligned request have ragged edges; everything else moves with O_DIRECT.

The pipeline knows nothing of CUDA or files: it drives a :class:`DeviceCopier` (host<->device
copies that return events) and a ``submit_io`` callable (the engine: host bytes <-> file, a
future per call). :class:`CudaCopier` is the real copier; tests use a CPU fake.

Completion: a request's future completes only after every copy event of the request has been
synchronised on the host, so when ``wait()``/``result()`` returns, the device data is in place
and visible to every stream; copies are ordered after the work queued on the caller's current
stream at submission (an event recorded there), so a tensor produced by a kernel launched just
before the call is written correctly.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from ..errors import DeepNVMeIOError, ShortTransferError
from ..memory.pinned import free_cpu_locked_tensor, new_cpu_locked_tensor
from ..memory.views import cast_to_byte_tensor
from .volume import VolumePath
from .workers import WorkerGroup

__all__ = ["DeviceCopier", "CudaCopier", "StagingPipeline", "StagedChunk", "plan_staged_chunks",
           "SubmitIO"]

log = logging.getLogger(__name__)
_CLOSED = "this handle's staging pipeline is closed; create a new handle"

#: ``submit_io(write, host_bytes, target, file_offset, *, validate, fsync) -> Future[int]``:
#: move all of the uint8 CPU tensor ``host_bytes`` to/from ``target`` (the engine's submit).
SubmitIO = Callable[..., "Future[int]"]


class DeviceCopier(Protocol):
    """Asynchronous host<->device copies; events are opaque to the pipeline.

    Call order per request: :meth:`begin` once on the submitting thread, then any number of
    :meth:`to_host`/:meth:`to_device` on the pipeline's thread, each followed eventually by
    :meth:`synchronize` of the event it returned.
    """

    def begin(self, device_tensor: torch.Tensor) -> Any:
        """Capture ordering on the caller's thread (e.g. an event on its current stream)."""
        ...

    def to_host(self, ticket: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start copying device ``src`` into pinned ``dst`` (same byte length); return an event."""
        ...

    def to_device(self, ticket: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Start copying pinned ``src`` into device ``dst``; return an event."""
        ...

    def synchronize(self, event: Any) -> None:
        """Block until the copy behind ``event`` finished; raise if it failed."""
        ...


class CudaCopier:
    """:class:`DeviceCopier` on one side CUDA stream per device (created on first use).

    ``begin`` records an event on the caller's current stream; the side stream waits for it
    before the request's first copy. ``synchronize`` is ``torch.cuda.Event.synchronize``.
    """

    def __init__(self) -> None:
        self._streams: dict[int, Any] = {}
        self._lock = threading.Lock()

    def _stream(self, device: torch.device) -> Any:
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            s = self._streams.get(index)
            if s is None:
                s = self._streams[index] = torch.cuda.Stream(device=index)
            return s

    def begin(self, device_tensor: torch.Tensor) -> Any:
        device = device_tensor.device
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return device, event

    def _copy(self, ticket: Any, dst: torch.Tensor, src: torch.Tensor) -> Any:
        device, after = ticket
        stream = self._stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    to_host = _copy
    to_device = _copy

    def synchronize(self, event: Any) -> None:
        event.synchronize()


@dataclasses.dataclass(frozen=True, slots=True)
class StagedChunk:
    """``length`` bytes at ``dev_offset`` of the tensor <-> ``file_offset``, staged at
    ``slot_offset`` inside a staging buffer."""

    dev_offset: int
    file_offset: int
    length: int
    slot_offset: int


def plan_staged_chunks(size: int, file_offset: int, *, chunk_bytes: int,
                       alignment: int) -> list[StagedChunk]:
    """Cut ``size`` bytes at ``file_offset`` into chunks ending on ``alignment`` multiples of
    the file offset, each at most ``chunk_bytes`` long (pure; ``chunk_bytes`` must be a
    multiple of ``alignment``). ``slot_offset`` = file offset mod alignment."""
    if chunk_bytes < alignment or chunk_bytes % alignment:
        raise ValueError(f"chunk_bytes ({chunk_bytes}) must be a positive multiple of the "
                         f"alignment ({alignment})")
    chunks: list[StagedChunk] = []
    done = 0
    while done < size:
        pos = file_offset + done
        end = min((pos // alignment) * alignment + chunk_bytes, file_offset + size)
        chunks.append(StagedChunk(done, pos, end - pos, pos % alignment))
        done = end - file_offset
    return chunks


@dataclasses.dataclass(eq=False)  # hashed by identity (kept in a set while open)
class _Request:
    write: bool
    device: torch.Tensor  # 1-D uint8 alias of the caller's tensor (keeps it alive)
    target: str | int | VolumePath
    file_offset: int
    validate: bool
    fsync: bool
    ticket: Any
    future: Future[int]

    @property
    def size(self) -> int:
        return self.device.numel()

    @property
    def name(self) -> str:
        return self.target if isinstance(self.target, str) else (
            f"<fd {self.target}>" if isinstance(self.target, int) else str(self.target))


class StagingPipeline:
    """Runs staged transfers on ``drivers`` threads (started on first use), each with its own
    ring of ``buffers`` pinned buffers of ``chunk_bytes + alignment`` bytes. Thread-safe.

    Requests are served in submission order per driver; one request's chunks are pipelined as
    the module docstring describes. The caller's tensor is kept alive until its future completes.
    """

    def __init__(self, submit_io: SubmitIO, copier: DeviceCopier, *, chunk_bytes: int,
                 buffers: int = 3, alignment: int = 4096, drivers: int = 1) -> None:
        if buffers < 2 or drivers < 1:
            raise ValueError(f"need buffers >= 2 and drivers >= 1, got {buffers}, {drivers}")
        chunk_bytes = max(alignment, -(-chunk_bytes // alignment) * alignment)
        self.submit_io = submit_io
        self.copier = copier
        self.chunk_bytes = chunk_bytes
        self.buffers = buffers
        self.alignment = alignment
        self.drivers = drivers
        self._workers = WorkerGroup(name="deepnvme-staging", closed_message=_CLOSED)
        self._queue = self._workers.queue
        self._lock = self._workers.lock
        self._open: set[_Request] = self._workers.open
        self._rings: list[list[torch.Tensor]] = []

    @property
    def memory_bound(self) -> int:
        """Most pinned bytes this pipeline allocates."""
        return self.drivers * self.buffers * (self.chunk_bytes + self.alignment)

    def submit(self, tensor: torch.Tensor, target: str | int | VolumePath, *, write: bool,
               offset: int = 0, validate: bool = False, fsync: bool = False) -> Future[int]:
        """Start moving all of ``tensor``'s bytes to/from ``target`` at ``offset``.

        Returns a future of the byte count; errors are set on it, never raised here. Must be
        called on the thread whose current stream produced/consumes ``tensor``.
        """
        self._workers.check_open()
        fut: Future[int] = Future()
        fut.set_running_or_notify_cancel()  # a started transfer cannot be cancelled
        dev = cast_to_byte_tensor(tensor)
        req = _Request(write, dev, target, int(offset), validate, fsync, None, fut)
        try:
            req.ticket = self.copier.begin(tensor)
        except BaseException as exc:
            fut.set_exception(exc)
            return fut
        with self._lock:
            self._workers.check_open()  # close() may have begun after the check above
            self._open.add(req)
            self._workers.start(self.drivers, _driver, self._driver_args)
        self._queue.put(req)
        return fut

    def _driver_args(self, i: int) -> tuple[Any, ...]:
        ring: list[torch.Tensor] = []  # the driver's staging buffers, allocated on first use
        self._rings.append(ring)
        return (weakref.ref(self), self._queue, ring)

    # --- one request, on a driver thread ---------------------------------------------------

    def _run(self, req: _Request, ring: list[torch.Tensor]) -> None:
        try:
            self._check_eof(req)
            chunks = plan_staged_chunks(req.size, req.file_offset, chunk_bytes=self.chunk_bytes,
                                        alignment=self.alignment)
            if not chunks:  # zero bytes: the engine still creates/opens the file
                empty = torch.empty(0, dtype=torch.uint8)
                self.submit_io(req.write, empty, req.target, req.file_offset,
                               validate=req.validate, fsync=req.fsync).result()
            else:
                while len(ring) < min(self.buffers, len(chunks)):
                    ring.append(new_cpu_locked_tensor(self.chunk_bytes + self.alignment, torch.uint8))
                (self._write if req.write else self._read)(req, chunks, ring)
                if req.write and req.fsync:
                    empty = torch.empty(0, dtype=torch.uint8)
                    self.submit_io(True, empty, req.target, req.file_offset + req.size,
                                   validate=False, fsync=True).result()
        except BaseException as exc:  # every failure goes to the future
            self._complete(req, exc)
        else:
            self._complete(req, None)

    def _check_eof(self, req: _Request) -> None:
        """Fail a read past EOF up front, like the engine does for a CPU buffer."""
        if req.write or isinstance(req.target, VolumePath):  # striped: checked by its layout
            return
        try:
            size = os.fstat(req.target).st_size if isinstance(req.target, int) else os.stat(req.target).st_size
        except OSError:
            return  # the engine reports the open error with its own wording
        if req.file_offset + req.size > size:
            raise ShortTransferError.past_end(path=req.name, offset=req.file_offset,
                                              size=req.size, file_size=size)

    def _staged(self, ring: list[torch.Tensor], i: int, c: StagedChunk) -> torch.Tensor:
        return ring[i % len(ring)][c.slot_offset:c.slot_offset + c.length]

    def _write(self, req: _Request, chunks: list[StagedChunk], ring: list[torch.Tensor]) -> None:
        k = len(ring)
        io: list[Future[int] | None] = [None] * k
        event: Any = None
        try:
            event = self._copy_in(req, ring, chunks, 0, io)
            for i, c in enumerate(chunks):
                pending, event = event, None
                self._sync(req, pending, c)
                io[i % k] = self.submit_io(True, self._staged(ring, i, c), req.target,
                                           c.file_offset, validate=req.validate, fsync=False)
                if i + 1 < len(chunks):
                    event = self._copy_in(req, ring, chunks, i + 1, io)
            for fut in io:
                if fut is not None:
                    fut.result()
        finally:
            self._drain(io, [] if event is None else [event])

    def _copy_in(self, req: _Request, ring: list[torch.Tensor], chunks: list[StagedChunk],
                 i: int, io: list[Future[int] | None]) -> Any:
        """Wait until chunk i's slot is free (its previous write finished), then start the copy."""
        k, c = len(ring), chunks[i]
        prev = io[i % k]
        if prev is not None:
            io[i % k] = None
            prev.result()
        return self.copier.to_host(req.ticket, self._staged(ring, i, c),
                                   req.device[c.dev_offset:c.dev_offset + c.length])

    def _read(self, req: _Request, chunks: list[StagedChunk], ring: list[torch.Tensor]) -> None:
        k, n = len(ring), len(chunks)
        io: list[Future[int] | None] = [None] * k
        for i in range(min(k, n)):
            self._refill(req, chunks, ring, i, io)
        copying: list[tuple[int, Any]] = []  # (chunk index, copy event) not yet synchronised
        try:
            for i, c in enumerate(chunks):
                fut, io[i % k] = io[i % k], None
                if fut is not None:
                    fut.result()
                copying.append((i, self.copier.to_device(
                    req.ticket, req.device[c.dev_offset:c.dev_offset + c.length],
                    self._staged(ring, i, c))))
                if len(copying) == 2:  # chunk i-1's slot is free once its copy finished
                    j, ev = copying.pop(0)
                    self._sync(req, ev, chunks[j])
                    self._refill(req, chunks, ring, j + k, io)
            while copying:
                j, ev = copying.pop(0)
                self._sync(req, ev, chunks[j])
        finally:
            self._drain(io, [ev for _, ev in copying])

    def _refill(self, req: _Request, chunks: list[StagedChunk], ring: list[torch.Tensor], j: int,
                io: list[Future[int] | None]) -> None:
        if j < len(chunks):
            io[j % len(ring)] = self.submit_io(False, self._staged(ring, j, chunks[j]), req.target,
                                               chunks[j].file_offset, validate=req.validate,
                                               fsync=False)

    def _sync(self, req: _Request, event: Any, c: StagedChunk) -> None:
        try:
            self.copier.synchronize(event)
        except DeepNVMeIOError:
            raise
        except Exception as exc:
            raise DeepNVMeIOError(f"{'device-to-host' if req.write else 'host-to-device'} copy "
                                  f"failed: {exc}", path=req.name, offset=c.file_offset,
                                  size=c.length) from exc

    def _drain(self, io: list[Future[int] | None], events: list[Any]) -> None:
        """After a failure: let in-flight I/O and copies finish before the ring is reused."""
        for fut in io:
            if fut is not None:
                fut.exception()
        for event in events:
            try:
                self.copier.synchronize(event)
            except Exception as exc:  # noqa: BLE001 - the request already failed; keep its error
                log.debug("deepnvme: copy after a failed staged request also failed: %s", exc)

    def _complete(self, req: _Request, exc: BaseException | None) -> None:
        with self._lock:
            self._open.discard(req)
        if exc is not None:
            req.future.set_exception(exc)
        else:
            req.future.set_result(req.size)

    # --- lifetime --------------------------------------------------------------------------

    def drain(self) -> None:
        """Block until every submitted request completed (errors stay on their futures)."""
        self._workers.drain()

    def close(self) -> None:
        """Refuse new requests, finish the admitted ones, stop the drivers, free the staging
        buffers. Idempotent."""
        if not self._workers.close():
            return
        for ring in self._rings:
            for buf in ring:
                free_cpu_locked_tensor(buf)
            ring.clear()


def _driver(ref: weakref.ref[StagingPipeline], work: queue.SimpleQueue[Any],
            ring: list[torch.Tensor]) -> None:
    while True:
        req = work.get()
        if req is None:
            return
        pipeline = ref()
        if pipeline is None:
            req.future.set_exception(RuntimeError("the staging pipeline was garbage-collected"))
            return
        pipeline._run(req, ring)
        del pipeline, req
