"""``TensorSwapper``: keyed tensors swapped between memory and files, through a pinned buffer pool.

Layout: one file per key (``<n>.swp`` in a private subdirectory), rewritten in place at offset
0. A key is usually a large tensor or a whole optimizer sub-group, so each swap is one large
transfer that the engine cuts into ``block_size`` chunks; per-key files need no allocator, never
fragment, and a rewrite with a new size needs nothing but the new length. Operations on one key
run in submission order (each is chained after the previous one); different keys overlap.

Memory bound: ``buffer_count x buffer_bytes`` of locked memory for swapped-in tensors, plus
copies of the tensors smaller than ``min_swap_bytes``, which never leave memory.
Thread-safety: all methods may be called from any thread.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Hashable, Iterable
from concurrent.futures import Future
from typing import Any

import torch

from ..memory.views import cast_to_byte_tensor, check_io_tensor
from ..config import IOConfig
from ..handles.aio import AioHandle
from ..memory.pinned import BufferPool
from . import _dirs
from ._slot import SwapBufferError, SwapError, _done, _Slot

__all__ = ["TensorSwapper", "SwapError", "SwapBufferError"]

log = logging.getLogger(__name__)


def _cleanup_at_exit(handle: AioHandle, owned: bool, path: str) -> None:
    """Finalizer (also run at interpreter exit): stop I/O, then delete the swap files."""
    try:
        if owned:
            handle.close()
        else:
            handle._engine.drain()
    finally:
        _dirs.remove_dir(path)


class TensorSwapper:
    """Swap tensors out to files under ``directory`` and back in, asynchronously.

    ``swap_out`` writes straight from the caller's tensor (which must stay unchanged until the
    returned future completes); ``swap_in`` reads into a pool buffer (valid until
    :meth:`release`) or into a tensor you pass. When all buffers are taken, a buffer request
    waits: with ``acquire_timeout=None`` only while some release is pending behind in-flight I/O,
    raising :class:`SwapBufferError` (naming the sizes) at once when no buffer can come free;
    with ``acquire_timeout`` seconds, for another thread's release up to that long.
    ``stale`` says what to do with swap directories left by crashed runs in ``directory``:
    ``"warn"`` (default; listed in :attr:`stale_dirs`), ``"remove"`` or ``"error"``.
    The swap files are deleted by :meth:`close`, or at interpreter exit if close was not called.
    ``handle`` (optional) is an :class:`AioHandle` to use instead of a new one from ``config``.
    """

    def __init__(self, directory: str | os.PathLike[str], *, config: IOConfig | None = None,
                 buffer_bytes: int = 64 << 20, buffer_count: int = 4, min_swap_bytes: int = 64 << 10,
                 acquire_timeout: float | None = None, stale: str = "warn",
                 handle: AioHandle | None = None) -> None:
        if buffer_bytes < 1 or buffer_count < 1:
            raise ValueError(f"buffer_bytes and buffer_count must be >= 1, got {buffer_bytes}, "
                             f"{buffer_count}")
        if stale not in ("warn", "remove", "error"):
            raise ValueError(f"stale must be 'warn', 'remove' or 'error', got {stale!r}")
        directory = os.fspath(directory)
        self.stale_dirs = _dirs.find_stale_dirs(directory)
        if self.stale_dirs:
            msg = (f"deepnvme: {len(self.stale_dirs)} stale swap director"
                   f"{'y' if len(self.stale_dirs) == 1 else 'ies'} from a crashed run in "
                   f"{directory}: {self.stale_dirs}")
            if stale == "error":
                raise SwapError(msg + "; delete them or pass stale='remove'", path=directory,
                                offset=None, size=None, errno=errno.EEXIST)
            if stale == "remove":
                for path in self.stale_dirs:
                    _dirs.remove_dir(path)
                log.warning("%s: removed", msg)
            else:
                warnings.warn(msg + "; pass stale='remove' to delete them", RuntimeWarning,
                              stacklevel=2)  # the warning only: not also a log line
        self.directory = _dirs.create_private_dir(directory)
        self.buffer_bytes = int(buffer_bytes)
        self.buffer_count = int(buffer_count)
        self.min_swap_bytes = int(min_swap_bytes)
        self.acquire_timeout = acquire_timeout
        owned = handle is None
        self._handle = AioHandle(config=config) if handle is None else handle
        self._pool = BufferPool(self.buffer_bytes, self.buffer_count)
        self._lock = threading.RLock()
        self._freed = threading.Condition(self._lock)  # notified when a buffer is given back
        self._slots: dict[Hashable, _Slot] = {}
        self._next_index = 0
        self._in_use = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, _cleanup_at_exit, self._handle, owned,
                                          self.directory)

    # --- queries ---------------------------------------------------------------------------

    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self._slots

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._slots)

    def nbytes(self, key: Hashable) -> int:
        """Bytes of the tensor last swapped out under ``key``."""
        return self._slot(key).nbytes

    def held_buffer(self, key: Hashable) -> torch.Tensor | None:
        """The raw uint8 pool buffer ``key`` holds (from swap_in or new_buffer), else None."""
        with self._lock:
            slot = self._slots.get(key)
            return None if slot is None else slot.buffer

    def buffers_in_use(self) -> int:
        """Pool buffers currently held by keys (the rest are free)."""
        with self._lock:
            return self._in_use

    # --- buffers ---------------------------------------------------------------------------

    def new_buffer(self, key: Hashable, shape: tuple[int, ...] | torch.Size,
                   dtype: torch.dtype) -> torch.Tensor:
        """A pool buffer of ``shape``/``dtype`` held by ``key`` until :meth:`release`; fill it,
        then ``swap_out(key, buffer)`` writes it with no copy. Blocks like :meth:`swap_in`."""
        self._check_open()
        with self._lock:
            slot = self._slots.get(key) or self._new_slot(key)
            if slot.buffer is not None:
                raise SwapBufferError(f"key {key!r} already holds a pool buffer; release(key) first")
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        raw = self._acquire(key, nbytes)
        with self._lock:
            slot.buffer, slot.buffer_current, slot.read = raw, False, None
        return raw[:nbytes].view(dtype).view(shape)

    def _acquire(self, key: Hashable, nbytes: int) -> torch.Tensor:
        self._check_fits(key, nbytes)
        timeout = self.acquire_timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._freed:
            while self._in_use >= self.buffer_count:
                if timeout is None and not any(s.release_when_idle for s in self._slots.values()):
                    holders = [s.key for s in self._slots.values() if s.buffer is not None]
                    raise SwapBufferError(
                        f"all {self.buffer_count} pool buffers of {self.buffer_bytes} bytes are "
                        f"held by swapped-in keys {holders[:8]}{'...' if len(holders) > 8 else ''} "
                        f"and none is being released, so a buffer for {key!r} ({nbytes} bytes) "
                        "would never come free; release(key) some or raise buffer_count (or "
                        "set acquire_timeout if another thread will release)")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SwapBufferError(
                        f"no free pool buffer for {key!r} ({nbytes} bytes) after {timeout} s: "
                        f"all {self.buffer_count} buffers of {self.buffer_bytes} bytes are in "
                        "use; release keys sooner or raise buffer_count")
                self._freed.wait(left)
            self._in_use += 1
        try:
            return self._pool.acquire()
        except BaseException:
            with self._lock:
                self._in_use -= 1
            raise

    def _check_fits(self, key: Hashable, nbytes: int) -> None:
        if nbytes > self.buffer_bytes:
            raise SwapBufferError(
                f"tensor {key!r} needs {nbytes} bytes but the pool's buffers hold "
                f"{self.buffer_bytes} bytes each; create the TensorSwapper with "
                f"buffer_bytes >= {nbytes}")

    def _give_back(self, slot: _Slot) -> None:
        """Return ``slot``'s buffer to the pool; caller holds the lock and no I/O uses it."""
        buf, slot.buffer, slot.read = slot.buffer, None, None
        slot.buffer_current = slot.release_when_idle = slot.hold_failed = False
        if buf is not None:
            self._pool.release(buf)
            self._in_use -= 1
            self._freed.notify_all()

    # --- swapping --------------------------------------------------------------------------

    def swap_out(self, key: Hashable, tensor: torch.Tensor) -> Future[None]:
        """Start writing ``tensor`` (contiguous, CPU) as the new value of ``key``.

        Tensors under ``min_swap_bytes`` are copied and kept in memory instead. Otherwise the
        bytes are written straight from ``tensor``: leave it unchanged until the future
        completes. A failure sets a :class:`SwapError` on the future; the tensor is untouched.
        """
        self._check_open()
        check_io_tensor(tensor, f"tensor for key {key!r}")
        nbytes = tensor.numel() * tensor.element_size()
        with self._lock:
            slot = self._slots.get(key) or self._new_slot(key)
            slot.shape, slot.dtype, slot.nbytes = tensor.shape, tensor.dtype, nbytes
            if nbytes < self.min_swap_bytes:
                slot.resident, slot.on_disk, slot.write_error = tensor.detach().clone(), False, None
                return _done(None)
            slot.resident, slot.on_disk = None, True  # reads queue behind this write
            from_buffer = (slot.buffer is not None and nbytes > 0
                           and tensor.data_ptr() == slot.buffer.data_ptr())  # its start, not a view inside
            slot.buffer_current = from_buffer
            # an earlier read's result is of the old value: its data (when not written from the
            # buffer), its shape/dtype, or the error of reading a key never written
            slot.read = None
        data = cast_to_byte_tensor(tensor)

        def finished(exc: BaseException | None) -> None:
            if exc is None:
                slot.write_error, slot.hold_failed = None, False
            else:
                slot.write_error = exc
                if from_buffer:
                    slot.release_when_idle, slot.hold_failed = False, True  # the only good copy
                    log.error("deepnvme: swap_out of %r failed; its buffer is kept so no data is "
                              "lost (swap_in returns it; release(key, force=True) frees it)", key)

        return self._chain(slot, "swap_out", lambda: self._handle.submit_write(data, slot.path),
                           lambda _n: None, finished)

    def swap_in(self, key: Hashable, out: torch.Tensor | None = None) -> Future[torch.Tensor]:
        """Start reading ``key``; the future gives a tensor of the shape/dtype swapped out.

        Without ``out`` the tensor is a view of a pool buffer held by ``key`` until
        :meth:`release` (a prefetched or still-held key returns the same future/buffer at once).
        With ``out`` (contiguous CPU, same byte size) the data lands there and no buffer is used.
        """
        self._check_open()
        slot = self._slot(key)
        if slot.resident is not None:
            if out is None:
                return _done(slot.resident)
            self._check_out(slot, out)
            cast_to_byte_tensor(out).copy_(cast_to_byte_tensor(slot.resident))
            return _done(out)
        if out is not None:
            self._check_out(slot, out)
            return self._read(slot, cast_to_byte_tensor(out), lambda _n: out)
        with self._lock:
            if slot.buffer is not None:
                return self._swap_in_held(slot)
        raw = self._acquire(key, slot.nbytes)
        with self._lock:
            if slot.buffer is not None:  # another thread swapped the key in meanwhile
                self._pool.release(raw)
                self._in_use -= 1
                self._freed.notify_all()
                return self._swap_in_held(slot)
            slot.buffer, slot.buffer_current, slot.read = raw, False, None
            return self._swap_in_held(slot)

    def _swap_in_held(self, slot: _Slot) -> Future[torch.Tensor]:
        """swap_in of a key that holds a buffer; the caller holds the lock."""
        slot.release_when_idle = False  # handed out again: call off a deferred release
        if slot.read is None:
            raw = slot.buffer
            assert raw is not None  # callers check; internal invariant
            if slot.buffer_current:
                slot.read = _done(slot.view(raw))
            else:  # the key's value came from another tensor: read it into the held buffer
                self._check_fits(slot.key, slot.nbytes)
                # the result's shape is the one swapped out now, not at completion (a later
                # swap_out, queued behind this read, changes the slot's)
                shape, dtype, nbytes = slot.shape, slot.dtype, slot.nbytes
                slot.read = self._read(slot, raw[:nbytes],
                                       lambda _n: raw[:nbytes].view(dtype).view(shape))
                slot.buffer_current = True
        return slot.read

    def prefetch(self, keys: Iterable[Hashable]) -> None:
        """Start swapping ``keys`` in to pool buffers; a later ``swap_in(key)`` picks them up.
        Blocks only while waiting for free buffers."""
        for key in keys:
            self.swap_in(key)

    def _read(self, slot: _Slot, target: torch.Tensor, result: Callable[[int], Any]) -> Future[Any]:
        if not slot.on_disk:
            return self._failed(slot, "swap_in", None, "the key was never written to its file")

        def start() -> Future[int]:
            if slot.write_error is not None:  # a swap_out queued before this read failed
                raise SwapError(f"swap_in of key {slot.key!r} impossible: the swap_out before it "
                                f"failed ({slot.write_error})", path=slot.path, offset=0,
                                size=slot.nbytes, errno=errno.EIO)
            return self._handle.submit_read(target, slot.path)
        return self._chain(slot, "swap_in", start, result, None)

    def _chain(self, slot: _Slot, op: str, start: Callable[[], Future[int]],
               result: Callable[[int], Any], finished: Callable[[BaseException | None], None] | None
               ) -> Future[Any]:
        """Run ``start`` after the key's previous op; the returned future gives ``result(n)``."""
        out: Future[Any] = Future()

        def complete(exc: BaseException | None, value: Any = None) -> None:
            if exc is not None:
                exc = self._wrap(slot, op, exc)
            with self._lock:
                if finished is not None:
                    releasing = slot.release_when_idle
                    finished(exc)
                    if releasing and not slot.release_when_idle:
                        self._freed.notify_all()  # a waiter counted on that release: re-check
                slot.pending -= 1
                if slot.pending == 0 and slot.release_when_idle:
                    self._give_back(slot)
            if exc is None:
                out.set_result(value)
            else:
                out.set_exception(exc)

        def on_io(f: Future[int]) -> None:
            exc = f.exception()
            complete(exc, None if exc is not None else result(f.result()))

        def go(_prev: Any = None) -> None:
            try:
                fut = start()
            except BaseException as exc:  # a submit error goes to the future like an I/O error
                complete(exc)
                return
            fut.add_done_callback(on_io)

        with self._lock:
            prev, slot.tail = slot.tail, out
            slot.pending += 1
        if prev is None:
            go()
        else:
            prev.add_done_callback(go)
        return out

    def _failed(self, slot: _Slot, op: str, cause: BaseException | None, why: str) -> Future[Any]:
        f: Future[Any] = Future()
        err = SwapError(f"{op} of key {slot.key!r} impossible: {why}" + (f" ({cause})" if cause else ""),
                        path=slot.path, offset=0, size=slot.nbytes, errno=errno.EIO)
        f.set_exception(err)
        return f

    def _wrap(self, slot: _Slot, op: str, exc: BaseException) -> BaseException:
        if not isinstance(exc, OSError):
            return exc
        gone = not os.path.isdir(self.directory)
        why = (f"the swap directory {self.directory} has vanished" if gone
               else f"swap directory {self.directory}: {exc}")
        keep = ("; the tensor passed to swap_out is untouched" if op == "swap_out"
                else "; the pool buffer is still held (release the key)")
        return SwapError(f"{op} of key {slot.key!r} ({slot.nbytes} bytes) failed: {why}{keep}",
                         path=getattr(exc, "path", None) or slot.path,
                         offset=getattr(exc, "offset", 0), size=getattr(exc, "size", None) or slot.nbytes,
                         errno=exc.errno)

    def _check_out(self, slot: _Slot, out: torch.Tensor) -> None:
        check_io_tensor(out, "out")
        n = out.numel() * out.element_size()
        if n != slot.nbytes:
            raise SwapBufferError(f"out has {n} bytes but key {slot.key!r} holds {slot.nbytes} "
                                  f"bytes ({tuple(slot.shape)} {slot.dtype})")

    # --- releasing -------------------------------------------------------------------------

    def release(self, key: Hashable, *, force: bool = False) -> None:
        """Give ``key``'s pool buffer back (once I/O using it finishes). Never blocks. Views from
        ``swap_in``/``new_buffer`` must not be used afterwards. A buffer whose swap_out failed
        holds the only good copy of the data: it stays with the key (``swap_in`` returns it)
        until a later swap_out succeeds or ``force=True`` drops it."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is None or slot.buffer is None:
                return
            if slot.hold_failed and not force:
                return
            if slot.pending == 0:
                self._give_back(slot)
            else:
                slot.release_when_idle = True

    def discard(self, key: Hashable) -> None:
        """Forget ``key``: wait for its I/O, free its buffer and delete its file."""
        slot = self._slot(key)
        tail = slot.tail
        if tail is not None:
            tail.exception()
        with self._lock:
            self._give_back(slot)
            del self._slots[key]
        try:
            os.unlink(slot.path)
        except FileNotFoundError:
            pass

    def wait(self) -> None:
        """Block until every started swap finished; raise the first failure, if any."""
        with self._lock:
            tails = [s.tail for s in self._slots.values() if s.tail is not None]
        errors = [t.exception() for t in tails]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def close(self) -> None:
        """Wait for I/O, free the buffers and delete the swap directory. Idempotent; failures of
        swaps nobody waited for are logged (call :meth:`wait` first to have them raised)."""
        if self._closed:
            return
        self._closed = True
        try:
            self.wait()
        except OSError as exc:
            log.error("deepnvme: a swap failed and was never waited for: %s", exc)
        with self._lock:
            for slot in self._slots.values():
                self._give_back(slot)
            self._slots.clear()
        self._pool.close()
        self._finalizer()

    def __enter__(self) -> "TensorSwapper":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- helpers ---------------------------------------------------------------------------

    def _new_slot(self, key: Hashable) -> _Slot:
        slot = _Slot(key, os.path.join(self.directory, f"{self._next_index}.swp"))
        self._next_index += 1
        self._slots[key] = slot
        return slot

    def _slot(self, key: Hashable) -> _Slot:
        with self._lock:
            slot = self._slots.get(key)
        if slot is None:
            raise KeyError(f"no tensor was swapped out under key {key!r}")
        return slot

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TensorSwapper is closed")

    def __repr__(self) -> str:
        return (f"TensorSwapper({self.directory!r}, buffer_bytes={self.buffer_bytes}, "
                f"buffer_count={self.buffer_count}, keys={len(self._slots)})")
