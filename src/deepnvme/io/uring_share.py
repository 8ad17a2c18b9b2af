"""Registered buffers shared between the io_uring rings of a process.

A worker's ring is single-issuer: once its thread has submitted, the kernel takes register
calls that touch it from that thread only, so another ring cannot clone a registration from it
(EEXIST). Measured with four workers: three clones of four refused, each ring then pinning the
whole buffer itself (LOG.md, 2026-11-29). So a locked allocation is registered once in a plain
ring of its own, the *source*: it never moves data, any thread may make its calls, and every
worker ring clones the registration from it (sharing the pinned pages). The source opens with
the first registration and closes with the last worker ring. Where the kernel cannot clone
(before Linux 6.13), each ring registers the allocation itself.

Locking: :data:`LOCK` guards the table of holders and is the source ring's own lock. Order: a
ring's own lock, then this one (re-entrant: a registration call may allocate, and the garbage
collector then run a release on this thread).
"""

from __future__ import annotations

import errno
import logging
import threading
import weakref
from typing import Any

__all__ = ["LOCK", "HOLDERS", "REFUSED", "register", "forget", "ring_opened", "ring_closed",
           "tidy_source"]

log = logging.getLogger(__name__)

LOCK = threading.RLock()
#: region -> the rings holding its registration (the source among them)
HOLDERS: dict[Any, list[Any]] = {}
#: the locked allocations that could not be registered (a memlock limit ...): not worth io_uring
REFUSED: weakref.WeakSet[Any] = weakref.WeakSet()
_source: list[Any] = []      # the source ring, while open (at most one)
_rings = [0]                 # worker rings open
_clones = [True]             # False once the kernel said it cannot clone


def register(ring: Any, region: object, base: int, size: int, slot: int) -> None:
    """Put ``region``'s registration (``size`` bytes at ``base``) in ``ring``'s ``slot``: cloned
    from the source, registered there first if needed; else registered by ``ring`` itself.
    Raises ``OSError`` where neither works. Caller holds :data:`LOCK`."""
    source = _holding_source(type(ring), region, base, size) if _clones[0] else None
    if source is not None:
        try:
            ring.clone_slot(source.fd, source.slot_of(region), slot)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):  # no clones on this kernel
                _clones[0] = False
            log.debug("deepnvme: io_uring buffer clone refused (%s)", exc)
        else:
            HOLDERS[region].append(ring)
            return
    ring._set_slot(slot, base, size)
    HOLDERS.setdefault(region, []).append(ring)


def _holding_source(kind: Any, region: object, base: int, size: int) -> Any:
    """The source ring (made as ``kind(1, plain=True)``, the workers' ring class), holding
    ``region`` (registered now if not yet); None where it has no free slot or cannot be made
    (the caller then registers on its own ring)."""
    if not _source:
        try:
            _source.append(kind(1, plain=True))
        except OSError as exc:
            log.debug("deepnvme: no io_uring source ring for shared buffers (%s)", exc)
            _clones[0] = False
            return None
    source = _source[0]
    if source.slot_of(region) >= 0:
        return source
    return source if source.fixed_slot_at(region, base, size) >= 0 else None


def forget(ring: Any, region: object) -> None:
    """``ring`` no longer holds ``region`` (caller holds :data:`LOCK`)."""
    rings = HOLDERS.get(region)
    if rings is not None and ring in rings:
        rings.remove(ring)
        if not rings:
            del HOLDERS[region]


def ring_opened() -> None:
    """A worker ring opened."""
    with LOCK:
        _rings[0] += 1


def ring_closed() -> None:
    """A worker ring closed: the source closes with the last one."""
    with LOCK:
        _rings[0] -= 1
        if _rings[0] > 0 or not _source:
            return
        source = _source.pop()
        source.close()


def tidy_source() -> None:
    """Drop the source's registrations of allocations freed meanwhile (a worker ring calls this
    when it tidies its own: a release that found :data:`LOCK` taken left them pending)."""
    if _source and _source[0]._released:
        with LOCK:
            if _source:
                _source[0].tidy()
