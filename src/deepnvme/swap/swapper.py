"""``TensorSwapper``: keyed tensors swapped between memory and files, through a pinned buffer pool.

Layout: one file per key (``<n>.swp`` in a private subdirectory), rewritten in place at offset
0. A key is usually a large tensor or a whole optimizer sub-group, so each swap is one large
transfer that the engine cuts into ``block_size`` chunks; per-key files need no allocator, never
fragment, and a rewrite with a new size needs nothing but the new length. This module is the
façade: buffers are lent by :mod:`._lending`, each key's ops are ordered by :mod:`._chain`.

Memory bound: ``buffer_count x buffer_bytes`` of locked memory for swapped-in tensors, plus
copies of the tensors smaller than ``min_swap_bytes``, which never leave memory.
Thread-safety: all methods may be called from any thread.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Hashable, Iterable
from concurrent.futures import Future

import torch

from ..config import IOConfig
from ..errors import SwapBufferError, SwapError
from ..handles.aio import AioHandle
from ..io.volume import Volume, VolumePath
from ..io.volume_files import remove as remove_striped
from ..memory.views import cast_to_byte_tensor, check_io_tensor
from . import _dirs
from ._lending import Lender
from ._slot import _done, _Slot

__all__ = ["TensorSwapper", "SwapError", "SwapBufferError"]

log = logging.getLogger(__name__)


def _cleanup_at_exit(handle: AioHandle, owned: bool, paths: tuple[str, ...],
                     made: tuple[str, ...]) -> None:
    """Finalizer (also run at interpreter exit): stop I/O, close the files, then delete them
    (and the directories the swapper created for them, if nothing else is in them)."""
    try:
        if owned:
            handle.close()
        else:
            handle.drain()
            for path in paths:
                handle.close_files(under=path)
    finally:
        for path in paths:
            _dirs.remove_dir(path)
        _dirs.remove_made_dirs(made)


class TensorSwapper:
    """Swap tensors out to files under ``directory`` and back in, asynchronously.

    ``swap_out`` writes straight from the caller's tensor (leave it unchanged until the future
    completes; the swapper never writes into it); a tensor of ``min_swap_bytes`` or more must
    fit one buffer (``buffer_bytes``), else swap_out raises :class:`SwapBufferError` at once.
    ``swap_in`` reads into a pool buffer lent to the key, or into a tensor you pass.
    ``buffer_count=0`` makes a swapper without a pool: any size may be swapped out and every
    ``swap_in`` needs ``out`` (the caller owns all memory, e.g. parameter offload).

    Buffer lifetime: a tensor from ``swap_in`` (without ``out``) or ``new_buffer`` is a view of a
    buffer lent to its key and is the caller's until ``release(key)`` (or discard/close): no
    swap_in or swap_out of any key writes into it meanwhile. If the key gets a new value from
    another tensor, the next swap_in reads into a fresh buffer; the old one stays lent (and
    counted) until release. After release the views must not be used: the buffer returns to the
    pool once no I/O uses it and will hold other keys' data.

    When all buffers are lent, a request waits: with ``acquire_timeout=None`` only while some
    release is pending behind in-flight I/O, raising :class:`SwapBufferError` (naming the sizes)
    at once when no buffer can come free; with ``acquire_timeout`` seconds, for another thread's
    release up to that long. ``stale`` says what to do with swap directories left by crashed
    runs in ``directory``: ``"warn"`` (default; listed in :attr:`stale_dirs`), ``"remove"`` or
    ``"error"``. The swap files are deleted by :meth:`close`, or at interpreter exit, with
    ``directory`` (and parents) if the swapper created it and it is then empty.
    ``handle`` (optional) is an :class:`AioHandle` to use instead of a new one from ``config``.
    ``directory`` may be a :class:`~deepnvme.Volume`: each drive gets a private directory and
    every key's file is striped over them, so a swap moves data on all drives at once.
    Each key's file stays open between swaps (the handle's ``keep_open``): at most one
    descriptor per key, up to the handle's limit, closed by :meth:`discard` and :meth:`close`.
    """

    def __init__(self, directory: str | os.PathLike[str] | Volume, *, config: IOConfig | None = None,
                 buffer_bytes: int = 64 << 20, buffer_count: int = 4, min_swap_bytes: int = 64 << 10,
                 acquire_timeout: float | None = None, stale: str = "warn",
                 handle: AioHandle | None = None) -> None:
        if buffer_bytes < 1 or buffer_count < 0:
            raise ValueError(f"buffer_bytes must be >= 1 and buffer_count >= 0, got "
                             f"{buffer_bytes}, {buffer_count}")
        if stale not in ("warn", "remove", "error"):
            raise ValueError(f"stale must be 'warn', 'remove' or 'error', got {stale!r}")
        places = list(directory.paths) if isinstance(directory, Volume) else [os.fspath(directory)]
        self.stale_dirs = [p for place in places for p in _dirs.handle_stale_dirs(place, stale)]
        made: tuple[str, ...] = ()
        privates: list[str] = []
        try:
            for place in places:
                made += _dirs.make_dirs(place)
                privates.append(_dirs.create_private_dir(place))
        except BaseException:
            for private in privates:
                _dirs.remove_dir(private)
            _dirs.remove_made_dirs(made)
            raise
        #: the private swap directory (the first drive's, on a volume)
        self.directory = privates[0]
        #: on a volume: the private directories as a volume its keys' files are striped over
        self.volume = (Volume(privates, stripe=directory.stripe)
                       if isinstance(directory, Volume) else None)
        self.buffer_bytes = int(buffer_bytes)
        self.buffer_count = int(buffer_count)
        self.min_swap_bytes = int(min_swap_bytes)
        self.acquire_timeout = acquire_timeout
        owned = handle is None
        self._handle = AioHandle(config=config) if handle is None else handle
        self._lender = Lender(self.buffer_bytes, max(self.buffer_count, 1))
        self._lock = self._lender.lock  # one lock for key state and buffers: no lock ordering
        self._slots: dict[Hashable, _Slot] = {}
        self._next_index = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, _cleanup_at_exit, self._handle, owned,
                                          tuple(privates), made)

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
            lease = None if slot is None else slot.held()
            return None if lease is None else lease.buffer

    def buffers_in_use(self) -> int:
        """Pool buffers lent and not yet back in the pool (the rest are free)."""
        return self._lender.in_use

    # --- buffers ---------------------------------------------------------------------------

    def new_buffer(self, key: Hashable, shape: tuple[int, ...] | torch.Size,
                   dtype: torch.dtype) -> torch.Tensor:
        """A pool buffer of ``shape``/``dtype`` held by ``key`` until :meth:`release`; fill it,
        then ``swap_out(key, buffer)`` writes it with no copy. Blocks like :meth:`swap_in`."""
        self._check_open()
        self._check_pool(key)
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self._lender.check_fits(key, nbytes)
        with self._lock:
            slot = self._slots.get(key) or self._new_slot(key)
            slot.check_no_buffer()
            slot.lease, slot.current, slot.read = None, False, None  # a released one goes on back
        lease = self._lender.lend(key, nbytes, self.acquire_timeout)
        with self._lock:
            try:
                slot.check_no_buffer()  # another thread's new_buffer/swap_in meanwhile
            except SwapBufferError:
                self._lender.release(lease)
                raise
            slot.lease, slot.current, slot.read = lease, False, None
        return lease.buffer[:nbytes].view(dtype).view(shape)

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
        if nbytes >= self.min_swap_bytes and self.buffer_count:  # else swap_in could never read it
            self._lender.check_fits(key, nbytes, op="swap_out")
        data = cast_to_byte_tensor(tensor)
        with self._lock:
            slot = self._slots.get(key) or self._new_slot(key)
            return slot.swap_out(self._handle, self._lender, tensor, data,
                                 keep_in_memory=nbytes < self.min_swap_bytes)

    def swap_in(self, key: Hashable, out: torch.Tensor | None = None) -> Future[torch.Tensor]:
        """Start reading ``key``; the future gives a tensor of the shape/dtype swapped out.

        Without ``out`` the tensor is a view of a pool buffer lent to ``key`` until
        :meth:`release` (a prefetched or still-held key returns the same future/buffer at once).
        With ``out`` (contiguous CPU, same byte size) the data lands there and no buffer is used.
        A small key kept in memory returns its kept tensor (the same one each time).
        """
        self._check_open()
        slot = self._slot(key)
        with self._lock:
            resident = slot.serve_resident(out)
        if resident is not None:
            return resident
        if out is not None:
            slot.check_out(out)
            with self._lock:
                return slot.read_into(self._handle, self._lender, cast_to_byte_tensor(out),
                                      self._lender.find(out), lambda: out)
        self._check_pool(key)
        with self._lock:
            held = slot.serve_held(self._lender)
            if held is not None:
                return held
        lease = self._lender.lend(key, slot.nbytes, self.acquire_timeout)
        with self._lock:  # another thread may have swapped the key in or out meanwhile
            held = _done(slot.resident) if slot.resident is not None else slot.serve_held(self._lender)
            if held is not None:
                self._lender.release(lease)
                return held
            return slot.read_into_lease(self._handle, self._lender, lease)

    def swap_in_range(self, key: Hashable, out: torch.Tensor, offset: int) -> Future[torch.Tensor]:
        """Start reading ``out``'s byte size from byte ``offset`` of ``key``'s file into ``out``
        (contiguous CPU); ordered after the key's earlier writes. The future gives ``out``."""
        self._check_open()
        check_io_tensor(out, "out")
        slot = self._slot(key)
        data = cast_to_byte_tensor(out)
        with self._lock:
            slot.check_range(offset, data.numel())
            return slot.read_into(self._handle, self._lender, data, self._lender.find(out),
                                  lambda: out, offset=offset)

    def swap_out_range(self, key: Hashable, tensor: torch.Tensor, offset: int) -> Future[None]:
        """Start writing ``tensor``'s bytes at byte ``offset`` of ``key``'s file, inside the
        value last swapped out (whose shape stays); ordered after the key's earlier I/O. Leave
        ``tensor`` unchanged until the future completes."""
        self._check_open()
        check_io_tensor(tensor, f"tensor for key {key!r}")
        slot = self._slot(key)
        data = cast_to_byte_tensor(tensor)
        with self._lock:
            slot.check_range(offset, data.numel())
            return slot.write(self._handle, self._lender, data, self._lender.find(tensor), False,
                              offset=offset)

    def prefetch(self, keys: Iterable[Hashable]) -> None:
        """Start swapping ``keys`` in to pool buffers; a later ``swap_in(key)`` picks them up.
        Blocks only while waiting for free buffers."""
        for key in keys:
            self.swap_in(key)

    # --- releasing -------------------------------------------------------------------------

    def release(self, key: Hashable, *, force: bool = False) -> None:
        """Give back every pool buffer lent to ``key`` (each once I/O using it finishes). Never
        blocks. Views from ``swap_in``/``new_buffer`` must not be used afterwards. A buffer whose
        swap_out failed holds the only good copy of the data: it stays with the key (``swap_in``
        returns it) until a later swap_out succeeds or ``force=True`` drops it."""
        with self._lock:
            slot = self._slots.get(key)
            if slot is not None:
                slot.release(self._lender, force=force)

    def discard(self, key: Hashable) -> None:
        """Forget ``key``: wait for its I/O, free its buffers and delete its file."""
        slot = self._slot(key)
        tail = slot.chain.last()
        if tail is not None:
            tail.exception()
        with self._lock:
            slot.release(self._lender, force=True)
            del self._slots[key]
        self._handle.close_files([slot.path])
        if isinstance(slot.path, VolumePath):
            remove_striped(slot.path)
            return
        try:
            os.unlink(slot.path)
        except FileNotFoundError:
            log.debug("deepnvme: key %r had no swap file to delete", key)

    def wait(self) -> None:
        """Block until every started swap finished; raise the first failure, if any."""
        with self._lock:
            tails = [t for t in (s.chain.last() for s in self._slots.values()) if t is not None]
        errors = [t.exception() for t in tails]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    @property
    def io_config(self) -> IOConfig:
        """The I/O settings of the handle the swapper reads and writes with."""
        return self._handle.config

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
            self._slots.clear()
            self._lender.close()
        self._finalizer()

    def __enter__(self) -> TensorSwapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- helpers ---------------------------------------------------------------------------

    def _new_slot(self, key: Hashable) -> _Slot:
        name = f"{self._next_index}.swp"
        slot = _Slot(key, self.volume / name if self.volume is not None
                     else os.path.join(self.directory, name))
        self._next_index += 1
        self._slots[key] = slot
        return slot

    def _slot(self, key: Hashable) -> _Slot:
        with self._lock:
            slot = self._slots.get(key)
        if slot is None:
            raise KeyError(f"no tensor was swapped out under key {key!r}")
        return slot

    def _check_pool(self, key: Hashable) -> None:
        if not self.buffer_count:
            raise SwapBufferError(f"key {key!r}: this TensorSwapper has no buffer pool "
                                  "(buffer_count=0); swap_in needs out=")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("TensorSwapper is closed")

    def __repr__(self) -> str:
        return (f"TensorSwapper({self.directory!r}, buffer_bytes={self.buffer_bytes}, "
                f"buffer_count={self.buffer_count}, keys={len(self._slots)})")
