"""One key of :class:`~deepnvme.swap.TensorSwapper`: its value, file, buffers and queued I/O.

The slot queues its reads and writes on its :class:`~._chain.Chain` and tells the
:class:`~._lending.Lender` which buffers they use, so a buffer is not lent again while I/O
reads from or lands in it. Thread-safety: methods are called with the lender's lock held
(completion callbacks take it themselves).
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

import torch

from ..errors import SwapBufferError, SwapError
from ..handles.aio import AioHandle
from ..io.volume import VolumePath
from ..memory.views import cast_to_byte_tensor, check_io_tensor
from ._chain import Chain
from ._lending import Lease, Lender

__all__ = ["SwapError", "SwapBufferError"]  # re-exported for code that imported them from here

log = logging.getLogger(__name__)


class _Slot:
    """``lease`` is the buffer the key holds: with ``current`` set it holds (or a queued read
    fills it with) the key's value, else it is a ``new_buffer`` being filled. ``stale`` are
    buffers handed out earlier whose contents are no longer the key's value: the caller may
    still use them, so they are never read into again and stay lent until release."""

    __slots__ = ("key", "path", "shape", "dtype", "nbytes", "resident", "on_disk", "lease",
                 "current", "stale", "read", "chain", "write_error")

    def __init__(self, key: Hashable, path: str | VolumePath) -> None:
        self.key = key
        self.path = path
        self.shape: torch.Size = torch.Size()
        self.dtype: torch.dtype = torch.uint8
        self.nbytes = 0
        self.resident: torch.Tensor | None = None   # small tensors kept in memory
        self.on_disk = False
        self.lease: Lease | None = None
        self.current = False
        self.stale: list[Lease] = []
        self.read: Future[torch.Tensor] | None = None  # the swap_in into ``lease``
        self.chain = Chain()
        self.write_error: BaseException | None = None

    # --- buffers ---------------------------------------------------------------------------

    def held(self) -> Lease | None:
        """The lease the key holds, forgetting one whose deferred release has completed."""
        if self.lease is not None and self.lease.returned:
            self.lease, self.current, self.read = None, False, None
        return self.lease

    def retire(self) -> None:
        """The held buffer stops being the key's value: it stays lent (its views may be in use)
        but is never read into again."""
        lease = self.held()
        if lease is not None:
            self.stale.append(lease)
            self.lease, self.current, self.read = None, False, None

    def leases(self) -> list[Lease]:
        """Every buffer lent to the key and not yet back in the pool."""
        held = self.held()
        self.stale = [x for x in self.stale if not x.returned]
        return self.stale + ([held] if held is not None else [])

    def release(self, lender: Lender, *, force: bool) -> None:
        """Give back every buffer lent to the key (kept ones only with ``force``)."""
        for lease in self.leases():
            lender.release(lease, force=force)
        self.leases()  # forget those already back in the pool

    def serve_held(self, lender: Lender) -> Future[torch.Tensor] | None:
        """A swap_in answered without a new buffer: the held one, or a failure; else None."""
        lease = self.held()
        if not self.on_disk:
            return self.failed("swap_in", "the key was never written to its file")
        if lease is None or not lender.reclaim(lease):  # reclaim: call off a pending release
            return None
        if self.read is None and self.current:
            self.read = _done(self.view(lease.buffer))
        if self.read is None:  # a new_buffer the caller may still use: read into a fresh one
            self.retire()
        return self.read

    def serve_resident(self, out: torch.Tensor | None) -> Future[torch.Tensor] | None:
        """A swap_in of a key kept in memory (its kept tensor, or copied into ``out``), else None."""
        if self.resident is None:
            return None
        if out is None:
            return _done(self.resident)
        self.check_out(out)
        cast_to_byte_tensor(out).copy_(cast_to_byte_tensor(self.resident))
        return _done(out)

    def check_no_buffer(self) -> None:
        """Refuse a new_buffer while the key holds one it has not released."""
        lease = self.held()
        if lease is not None and not lease.returning:
            raise SwapBufferError(f"key {self.key!r} already holds a pool buffer; release(key) first")

    def view(self, raw: torch.Tensor) -> torch.Tensor:
        return raw[: self.nbytes].view(self.dtype).view(self.shape)

    # --- I/O, in order on the key's chain ----------------------------------------------------

    def swap_out(self, handle: AioHandle, lender: Lender, tensor: torch.Tensor, data: torch.Tensor,
                 *, keep_in_memory: bool) -> Future[None]:
        """Make ``tensor`` (``data``: its bytes) the key's value: a copy kept in memory, or a
        queued write straight from it (no copy when it is the start of the key's own buffer)."""
        self.shape, self.dtype, self.nbytes = tensor.shape, tensor.dtype, data.numel()
        if keep_in_memory:
            self.retire()
            self.resident, self.on_disk, self.write_error = tensor.detach().clone(), False, None
            return _done(None)
        self.resident, self.on_disk = None, True  # reads queue behind this write
        source = lender.find(tensor)              # a lent buffer the bytes come from
        own = self.held()
        from_own = own is not None and source is own and data.data_ptr() == own.buffer.data_ptr()
        if from_own:  # the key's buffer holds the new value (from its start, not a view inside)
            self.current, self.read = True, None
        else:
            self.retire()
        return self.write(handle, lender, data, source, from_own)

    def read_into_lease(self, handle: AioHandle, lender: Lender, lease: Lease) -> Future[torch.Tensor]:
        """Queue reading the key into a freshly lent buffer, which the key then holds."""
        self.lease, self.current = lease, True
        shape, dtype, nbytes, raw = self.shape, self.dtype, self.nbytes, lease.buffer
        # the result's shape is the one swapped out now, not at completion (a later swap_out,
        # queued behind this read, changes the slot's)
        self.read = self.read_into(handle, lender, raw[:nbytes], lease,
                                   lambda: raw[:nbytes].view(dtype).view(shape))
        return self.read

    def write(self, handle: AioHandle, lender: Lender, data: torch.Tensor, source: Lease | None,
              from_own: bool, *, offset: int | None = None) -> Future[None]:
        """Queue writing ``data`` (inside ``source``'s buffer, if any; the key's own buffer at
        its start if ``from_own``). A failed write from the own buffer keeps that buffer.
        ``offset``: write a range of the file at that byte (the key's value stays; a success
        does not clear an earlier write's failure)."""
        if source is not None:
            lender.use(source)

        def settle(exc: BaseException | None, _n: int) -> None:
            with lender.lock:
                if source is not None:
                    if exc is not None and from_own:
                        lender.keep(source)
                        log.error("deepnvme: swap_out of %r failed; its buffer is kept so no data "
                                  "is lost (swap_in returns it; release(key, force=True) frees it)",
                                  self.key)
                    lender.done_using(source)
                if exc is None and offset is not None:
                    return
                if exc is None:
                    self.write_error = None
                    for lease in self.leases():
                        lender.unkeep(lease)
                    return
                self.write_error = err = self.wrap("swap_out", exc)
            raise err
        return self.chain.then(lambda: handle.submit_write(data, self.path, offset=offset or 0,
                                                           keep_open=True), settle)

    def read_into(self, handle: AioHandle, lender: Lender, target: torch.Tensor,
                  lease: Lease | None, result: Callable[[], Any], *, offset: int = 0) -> Future[Any]:
        """Queue reading the file (from byte ``offset``) into ``target`` (inside ``lease``'s
        buffer, if any); the future gives ``result()``."""
        if lease is not None:
            lender.use(lease)

        def start() -> Future[int]:
            if self.write_error is not None:  # a swap_out queued before this read failed
                raise SwapError(f"swap_in of key {self.key!r} impossible: the swap_out before it "
                                f"failed ({self.write_error})", path=str(self.path), offset=0,
                                size=self.nbytes, errno=errno.EIO)
            return handle.submit_read(target, self.path, offset=offset, keep_open=True)

        def settle(exc: BaseException | None, _n: int) -> Any:
            if lease is not None:
                lender.done_using(lease)
            if exc is not None:
                raise self.wrap("swap_in", exc)
            return result()
        return self.chain.then(start, settle)

    # --- errors ------------------------------------------------------------------------------

    def failed(self, op: str, why: str) -> Future[Any]:
        return _failed(SwapError(f"{op} of key {self.key!r} impossible: {why}", path=str(self.path),
                                 offset=0, size=self.nbytes, errno=errno.EIO))

    def wrap(self, op: str, exc: BaseException) -> BaseException:
        """``exc`` as a :class:`SwapError` naming the key, the op and what is kept."""
        if not isinstance(exc, OSError):
            return exc
        dirs = (list(self.path.volume.paths) if isinstance(self.path, VolumePath)
                else [os.path.dirname(self.path)])
        gone = [d for d in dirs if not os.path.isdir(d)]
        why = (f"the swap directory {gone[0]} has vanished" if gone
               else f"swap directory {', '.join(dirs)}: {exc}")
        keep = ("; the tensor passed to swap_out is untouched" if op == "swap_out"
                else "; the pool buffer is still held (release the key)")
        return SwapError(f"{op} of key {self.key!r} ({self.nbytes} bytes) failed: {why}{keep}",
                         path=getattr(exc, "path", None) or str(self.path),
                         offset=getattr(exc, "offset", 0), size=getattr(exc, "size", None) or self.nbytes,
                         errno=exc.errno)

    def check_range(self, offset: int, nbytes: int) -> None:
        """Refuse a range outside the value on disk (or a key kept in memory)."""
        if not self.on_disk or offset < 0 or offset + nbytes > self.nbytes:
            raise SwapBufferError(f"range {offset}..{offset + nbytes} of key {self.key!r} is not "
                                  f"inside its {self.nbytes} bytes on disk")

    def check_out(self, out: torch.Tensor) -> None:
        check_io_tensor(out, "out")
        n = out.numel() * out.element_size()
        if n != self.nbytes:
            raise SwapBufferError(f"out has {n} bytes but key {self.key!r} holds {self.nbytes} "
                                  f"bytes ({tuple(self.shape)} {self.dtype})")


def _done(value: Any) -> Future[Any]:
    f: Future[Any] = Future()
    f.set_result(value)
    return f


def _failed(exc: BaseException) -> Future[Any]:
    f: Future[Any] = Future()
    f.set_exception(exc)
    return f
