"""Lending the swapper's pinned pool buffers to keys, with waits and deferred returns.

A buffer is lent to one key as a :class:`Lease`. The key gives it back with :meth:`Lender.release`,
but the buffer reaches the pool only once no I/O uses it (``users == 0``): a write reading from
it or a read landing in it keeps it out of the pool, whichever key that I/O belongs to. A lease
whose write failed holds the only good copy of the data: it is *kept* and only a forced release
frees it. Memory bound: ``count x buffer_bytes`` of locked memory, created on first use.
Thread-safety: every method takes :attr:`Lender.lock` (reentrant, shared with the swapper).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Hashable

import torch

from ..errors import SwapBufferError
from ..memory.pinned import BufferPool

__all__ = ["Lease", "Lender"]

log = logging.getLogger(__name__)


class Lease:
    """One pool buffer lent to ``key``; the fields change only under the lender's lock."""

    __slots__ = ("buffer", "key", "users", "returning", "kept", "returned")

    def __init__(self, buffer: torch.Tensor, key: Hashable) -> None:
        self.buffer = buffer         # raw uint8, ``buffer_bytes`` long
        self.key = key               # the borrower, for messages
        self.users = 0               # I/O operations in flight on this buffer
        self.returning = False       # released: goes back to the pool when ``users`` hits 0
        self.kept = False            # a failed write from it: holds the only copy of the data
        self.returned = False        # back in the pool: the key must not use it any more

    def holds(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor``'s first byte lies inside this buffer."""
        start = self.buffer.data_ptr()
        return start <= tensor.data_ptr() < start + self.buffer.numel()


class Lender:
    """Lends ``count`` buffers of ``buffer_bytes``; a request waits while none is free.

    With ``timeout=None`` a request waits only while some release is pending behind in-flight
    I/O (the buffer will come back by itself) and raises :class:`SwapBufferError` at once when
    nothing can come free; with a timeout it waits up to that long for any release.
    """

    def __init__(self, buffer_bytes: int, count: int) -> None:
        self.buffer_bytes = buffer_bytes
        self.count = count
        self.lock = threading.RLock()
        self._returned = threading.Condition(self.lock)  # notified when a release may help
        self._pool = BufferPool(buffer_bytes, count)
        self._lent: list[Lease] = []

    @property
    def in_use(self) -> int:
        """Buffers lent and not yet back in the pool (deferred releases included)."""
        with self.lock:
            return len(self._lent)

    def check_fits(self, key: Hashable, nbytes: int, op: str | None = None) -> None:
        """Raise :class:`SwapBufferError` if ``nbytes`` exceed one buffer (naming ``op``, the
        swap_out that would write what no swap_in could read back)."""
        if nbytes > self.buffer_bytes and op is not None:
            raise SwapBufferError(
                f"{op} of key {key!r}: the tensor has {nbytes} bytes but each swap buffer holds "
                f"{self.buffer_bytes} bytes, so swap_in could never read it back; nothing was "
                f"written. Create the TensorSwapper with buffer_bytes >= {nbytes}")
        if nbytes > self.buffer_bytes:
            raise SwapBufferError(
                f"tensor {key!r} needs {nbytes} bytes but the pool's buffers hold "
                f"{self.buffer_bytes} bytes each; create the TensorSwapper with "
                f"buffer_bytes >= {nbytes}")

    def lend(self, key: Hashable, nbytes: int, timeout: float | None) -> Lease:
        """A buffer for ``key`` (``nbytes`` of data), waiting for a release as described above."""
        self.check_fits(key, nbytes)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._returned:
            while len(self._lent) >= self.count:
                if timeout is None and not any(x.returning for x in self._lent):
                    holders = sorted({repr(x.key) for x in self._lent})
                    raise SwapBufferError(
                        f"all {self.count} pool buffers of {self.buffer_bytes} bytes are held by "
                        f"swapped-in keys [{', '.join(holders[:8])}{', ...' if len(holders) > 8 else ''}] "
                        f"and none is being released, so a buffer for {key!r} ({nbytes} bytes) "
                        "would never come free; release(key) some or raise buffer_count (or set "
                        "acquire_timeout if another thread will release)")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise SwapBufferError(
                        f"no free pool buffer for {key!r} ({nbytes} bytes) after {timeout} s: "
                        f"all {self.count} buffers of {self.buffer_bytes} bytes are in use; "
                        "release keys sooner or raise buffer_count")
                self._returned.wait(left)
            # never blocks: fewer than ``count`` buffers are lent, so one is free or creatable
            lease = Lease(self._pool.acquire(), key)
            self._lent.append(lease)
            return lease

    def use(self, lease: Lease) -> None:
        """An I/O operation on ``lease``'s buffer starts: the buffer stays out of the pool."""
        with self.lock:
            lease.users += 1

    def done_using(self, lease: Lease) -> None:
        """That operation ended; a deferred release completes when it was the last."""
        with self.lock:
            lease.users -= 1
            if lease.users == 0 and lease.returning:
                self._to_pool(lease)

    def release(self, lease: Lease, *, force: bool = False) -> bool:
        """Give ``lease`` back (at once, or when its I/O ends). A kept lease is given back only
        with ``force``; returns False when it stays lent for that reason."""
        with self.lock:
            if lease.returned:
                return True
            if lease.kept and not force:
                return False
            lease.kept = False
            if lease.users == 0:
                self._to_pool(lease)
            elif not lease.returning:
                lease.returning = True
                self._returned.notify_all()  # a waiter with timeout=None may now wait
            return True

    def reclaim(self, lease: Lease) -> bool:
        """Call off a deferred release (the key hands the buffer out again); False if the buffer
        is already back in the pool."""
        with self.lock:
            lease.returning = False
            return not lease.returned

    def keep(self, lease: Lease) -> None:
        """A write from ``lease`` failed: it holds the only copy, so it stays lent until a forced
        release, even if a release was pending (waiters counting on it re-check and may fail)."""
        with self.lock:
            lease.kept = True
            if lease.returning:
                lease.returning = False
                self._returned.notify_all()

    def unkeep(self, lease: Lease) -> None:
        """A later write of the key succeeded: ``lease`` is no longer the only copy."""
        with self.lock:
            lease.kept = False

    def find(self, tensor: torch.Tensor) -> Lease | None:
        """The lease whose buffer holds ``tensor`` (a view handed out earlier), else None."""
        if tensor.numel() == 0:
            return None
        with self.lock:
            return next((x for x in self._lent if x.holds(tensor)), None)

    def close(self) -> None:
        """Return every lease and free the pool's buffers (the caller stopped all I/O)."""
        with self.lock:
            for lease in list(self._lent):
                self._to_pool(lease)
            self._pool.close()

    def _to_pool(self, lease: Lease) -> None:
        """Put ``lease``'s buffer back; the caller holds the lock and no I/O uses the buffer."""
        lease.returning = lease.kept = False
        lease.returned = True
        self._lent.remove(lease)
        self._pool.release(lease.buffer)
        self._returned.notify_all()
