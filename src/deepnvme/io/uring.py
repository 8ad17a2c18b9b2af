"""io_uring from Python through ctypes on the three system calls: no compile step, no dependency.

One :class:`UringQueue` is one ring, used by one worker thread only. Entries are written
straight into the kernel-shared submission ring (``struct.pack_into`` on the mmap), submitted
in batches by ``io_uring_enter``, which also waits for completions; ctypes releases the GIL
for the whole system call, so the kernel works while Python threads run.

Memory ordering: the submission tail is published and the completion tail read only around
``io_uring_enter`` (a system call orders both ways), never by polling shared memory.

Completions (Linux 6.1+): the ring is set up single-issuer with deferred task work, as fio
sets it up: the kernel posts completions only inside ``io_uring_enter`` with GETEVENTS on the
ring's own thread, and wakes a waiter once ``min_complete`` of them are ready, instead of
interrupting the thread once per completion. A single-issuer ring takes system calls
(submissions and buffer registrations) from one thread only: the first that submits
(:meth:`UringQueue.submit_and_wait`); see :meth:`UringQueue.region_released` for frees seen on
other threads.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
import platform
import struct
import threading
from typing import Any

import torch

from ..memory import pinned
from . import uring_share as share
from .posix import syscall, syscall_function

log = logging.getLogger(__name__)

__all__ = ["UringQueue", "probe_io_uring"]

_SYS_SETUP, _SYS_ENTER, _SYS_REGISTER = 425, 426, 427  # same on x86_64 and aarch64
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_ENTER_GETEVENTS = 1
# single issuer + deferred task work (Linux 6.1+), created disabled: enabled by the thread that
# first submits (IORING_REGISTER_ENABLE_RINGS), which becomes the ring's one issuer
_SETUP_R_DISABLED, _SETUP_SINGLE_ISSUER, _SETUP_DEFER_TASKRUN = 1 << 6, 1 << 12, 1 << 13
_REGISTER_ENABLE_RINGS = 12
_FEAT_SINGLE_MMAP, _FEAT_NODROP, _FEAT_RW_CUR_POS = 1 << 0, 1 << 1, 1 << 3
_OP_READ, _OP_WRITE, _OP_READ_FIXED, _OP_WRITE_FIXED = 22, 23, 4, 5
_REGISTER_BUFFERS2, _REGISTER_BUFFERS_UPDATE, _RSRC_REGISTER_SPARSE = 15, 16, 1
_REGISTER_CLONE_BUFFERS, _CLONE_DST_REPLACE = 30, 1 << 1  # Linux 6.13+: clone into one slot
FIXED_SLOTS = 64  # registered-buffer table entries per ring
_MAX_LEN = 0x7FFFF000  # the kernel's largest single read/write; longer chunks complete short

# struct io_uring_params: 10 u32 fields, then the SQ and CQ ring offsets (10 u32 each with a u64)
_PARAMS = struct.Struct("<10I" + "8IQ" + "8IQ")
# struct io_uring_sqe (64 B): opcode, flags, ioprio, fd, off, addr, len, rw_flags, user_data, buf_index
_SQE = struct.Struct("<BBHiQQIIQH22x")
_RSRC_REGISTER = struct.Struct("<IIQQQ")  # nr, flags, resv2, data, tags
_RSRC_UPDATE = struct.Struct("<IIQQII")  # offset, resv, data, tags, nr, resv2
_CLONE = struct.Struct("<IIIII12x")  # src_fd, flags, src_off, dst_off, nr, pad
_CQE = struct.Struct("<QiI")
# io_uring_enter(fd, to_submit, min_complete, flags, sigset, sigset size), typed once
_enter = syscall_function(ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                          ctypes.c_void_p, ctypes.c_size_t)

# the rings holding each registered allocation, and the lock over them: see .uring_share
_holders_lock, _holders, REFUSED = share.LOCK, share.HOLDERS, share.REFUSED


class UringQueue:
    """One io_uring with ``depth`` entries: :meth:`prep` queues, :meth:`submit_and_wait` runs.

    Not thread-safe: each worker owns its own queue (only :meth:`region_released` may come
    from another thread). Raises ``OSError`` from the constructor where io_uring is
    unavailable (ENOSYS, EPERM from a sysctl or seccomp, ENOMEM).

    Registered buffers: locked allocations of :mod:`deepnvme.memory.pinned` are registered
    with the ring on first use (:meth:`fixed_slot`, up to :data:`FIXED_SLOTS` of them), so
    their transfers skip pinning pages per request (READ_FIXED/WRITE_FIXED); a registration
    ends when its allocation is freed (on a single-issuer ring freed on another thread: at the
    ring's next call on its own thread, see :meth:`region_released`) or the ring closes.
    """

    name = "io_uring"
    #: wait for a quarter of the entries in flight per call: with deferred task work the kernel
    #: wakes the waiter once, when that many are ready (fewer, fuller rounds; 2026-11-29 log:
    #: 4 KiB random reads at depth 32, +25 % IOPS on the disk at 0.7x the CPU per read vs one)
    wait_share = 4
    small_wait_share = 4  # the same for small reads (:mod:`deepnvme.io.small`)

    def __init__(self, depth: int, *, plain: bool = False) -> None:
        params = bytearray(_PARAMS.size)
        #: ``plain``: the source of shared registrations (.uring_share), never a worker's ring
        self.plain = plain
        fd = -1 if plain else _setup(max(1, depth), params, _SETUP_R_DISABLED | _SETUP_SINGLE_ISSUER
                                     | _SETUP_DEFER_TASKRUN)
        #: single issuer: system calls from the thread that first submits only (its id, in
        #: ``_issuer`` from then on)
        self.single_issuer = fd >= 0
        self._issuer: int | None = None
        if fd < 0:  # an older kernel: a plain ring
            fd = _setup(max(1, depth), params, 0)
        self.fd = fd
        try:
            self._map(_PARAMS.unpack(params))
        except BaseException:
            os.close(fd)
            raise
        self.depth = min(depth, self.sq_entries)
        # re-entrant: a registration syscall allocates, the GC may free a locked allocation
        # then, and its finalizer calls region_released on this thread
        self._fixed_lock = share.LOCK if plain else threading.RLock()
        self._fixed: dict[Any, int] | None = None
        self._free_slots: list[int] = []
        # regions freed while another thread held this ring's lock: dropped at the next
        # fixed_slot (see region_released); list.append and pop are atomic
        self._released: list[Any] = []
        self._init_fixed()
        if not plain:
            share.ring_opened()

    registers = property(lambda self: self._fixed is not None, doc="buffers can be registered")

    def _map(self, p: tuple[int, ...]) -> None:
        sq_entries, cq_entries, features = p[0], p[1], p[5]
        sq_off, cq_off = p[10:19], p[19:28]
        if not features & _FEAT_RW_CUR_POS:
            raise OSError(errno.ENOSYS, "this kernel's io_uring lacks IORING_OP_READ/WRITE "
                                        "(Linux 5.6 or newer needed)")
        self.sq_entries, self.nodrop = sq_entries, bool(features & _FEAT_NODROP)
        sq_size = sq_off[6] + sq_entries * 4
        cq_size = cq_off[5] + cq_entries * _CQE.size
        prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        if features & _FEAT_SINGLE_MMAP:
            size = max(sq_size, cq_size)
            self._sq_map = mmap.mmap(self.fd, size, flags, prot, offset=_OFF_SQ_RING)
            self._cq_map = self._sq_map
        else:
            self._sq_map = mmap.mmap(self.fd, sq_size, flags, prot, offset=_OFF_SQ_RING)
            self._cq_map = mmap.mmap(self.fd, cq_size, flags, prot, offset=_OFF_CQ_RING)
        self._sqes = mmap.mmap(self.fd, sq_entries * _SQE.size, flags, prot, offset=_OFF_SQES)
        self._sqe_array = (ctypes.c_char * (sq_entries * _SQE.size)).from_buffer(self._sqes)
        self._sqe_at = ctypes.addressof(self._sqe_array)
        sq = memoryview(self._sq_map).cast("I")
        cq = memoryview(self._cq_map).cast("I")
        self._sq, self._cq = sq, cq
        self._sq_head, self._sq_tail = sq_off[0] // 4, sq_off[1] // 4
        self._sq_mask = sq[sq_off[2] // 4]
        self._cq_head, self._cq_tail = cq_off[0] // 4, cq_off[1] // 4
        self._cq_mask = cq[cq_off[2] // 4]
        self._cqes = cq_off[5]
        # the completion entries as u64 (user_data at 2*i) and i32 (res at 4*i + 2) views
        self._cq_tags = memoryview(self._cq_map)[self._cqes:self._cqes + cq_entries * _CQE.size].cast("Q")
        self._cq_res = memoryview(self._cq_map)[self._cqes:self._cqes + cq_entries * _CQE.size].cast("i")
        array = sq_off[6] // 4
        for i in range(sq_entries):  # identity map: ring slot i holds sqe i
            sq[array + i] = i
        self._tail = sq[self._sq_tail]

    # --- registered buffers ----------------------------------------------------------------

    def _init_fixed(self) -> None:
        """A sparse table of buffer slots (Linux 5.19+); without it, no registered buffers."""
        arg = bytearray(_RSRC_REGISTER.pack(FIXED_SLOTS, _RSRC_REGISTER_SPARSE, 0, 0, 0))
        try:
            self._register(_REGISTER_BUFFERS2, arg, _RSRC_REGISTER.size)
        except OSError as exc:
            log.debug("deepnvme: io_uring without registered buffers (%s)", exc)
            return
        self._fixed, self._free_slots = {}, list(range(FIXED_SLOTS - 1, -1, -1))
        pinned.add_release_listener(self)

    def _register(self, opcode: int, arg: bytearray, nr: int) -> None:
        buf = (ctypes.c_char * len(arg)).from_buffer(arg)
        try:
            syscall(_SYS_REGISTER, ctypes.c_uint(self.fd), ctypes.c_uint(opcode), buf,
                    ctypes.c_uint(nr))
        finally:
            del buf

    def _set_slot(self, slot: int, base: int, size: int) -> None:
        iov = (ctypes.c_uint64 * 2)(base, size)
        arg = bytearray(_RSRC_UPDATE.pack(slot, 0, ctypes.addressof(iov), 0, 1, 0))
        self._register(_REGISTER_BUFFERS_UPDATE, arg, _RSRC_UPDATE.size)

    def fixed_slot(self, address: int, length: int) -> int:
        """The registered-buffer slot covering ``[address, address + length)``, registering
        its locked allocation on first use; -1 if it is not locked memory or cannot be."""
        if self._fixed is None:
            return -1
        found = pinned.locked_region(address, length)
        if found is None:
            return -1
        region, base, size = found
        with self._fixed_lock:
            self._drop_released()
            slot = self._fixed.get(region)
            if slot is not None or not self._free_slots:
                return -1 if slot is None else slot
            slot = self._free_slots.pop()
            with share.LOCK:
                try:
                    share.register(self, region, base, size, slot)
                except OSError as exc:  # e.g. a memlock limit: go on without for this region
                    log.debug("deepnvme: io_uring buffer registration refused (%s)", exc)
                    self._free_slots.append(slot)
                    share.REFUSED.add(region)
                    return -1
            self._fixed[region] = slot
            return slot

    def fixed_slot_at(self, region: object, base: int, size: int) -> int:
        """(The source ring) register ``region`` in a free slot, or -1; may raise ``OSError``."""
        self._drop_released()
        if self._fixed is None or not self._free_slots:
            return -1
        slot = self._free_slots.pop()
        try:
            self._set_slot(slot, base, size)
        except OSError:
            self._free_slots.append(slot)
            raise
        self._fixed[region] = slot
        share.HOLDERS.setdefault(region, []).append(self)
        return slot

    def slot_of(self, region: object) -> int:
        """The slot holding ``region``'s registration, or -1."""
        return -1 if self._fixed is None else self._fixed.get(region, -1)

    def clone_slot(self, src_fd: int, src_slot: int, slot: int) -> None:
        """Clone slot ``src_slot`` of ring ``src_fd`` into this ring's ``slot`` (no new pinning)."""
        self._register(_REGISTER_CLONE_BUFFERS, bytearray(_CLONE.pack(src_fd, _CLONE_DST_REPLACE,
                                                                      src_slot, slot, 1)), 1)

    def region_released(self, region: object) -> None:
        """A locked allocation was freed: drop its registration (any thread). Never waits for
        this ring's lock: the finalizer that calls it can run inside another ring's
        registration (a syscall's allocation starting the GC) on a thread that holds
        ``_holders_lock``, while a third thread holds this ring's lock and waits for
        ``_holders_lock``. When the lock is taken, or the ring is single-issuer and this is
        not its thread (the kernel refuses the call, EEXIST), the region waits for the ring's
        next :meth:`fixed_slot`, :meth:`submit_and_wait` or :meth:`tidy` (its pages stay pinned
        until then; its address is not reused by this table, which is keyed by region)."""
        self._released.append(region)
        if self.single_issuer and self._issuer != threading.get_ident():
            return
        if not self._fixed_lock.acquire(blocking=False):
            return
        try:
            self._drop_released()
        finally:
            self._fixed_lock.release()

    def tidy(self) -> bool:
        """Drop the registrations of allocations freed so far (on the ring's own thread);
        True while the ring holds registrations (frees on other threads then wait for the next
        call: a worker that idles calls this now and then)."""
        if self._released:
            with self._fixed_lock:
                self._drop_released()
        return bool(self._fixed) and self.single_issuer

    def _drop_released(self) -> None:
        """Unregister the regions freed so far (caller holds ``_fixed_lock``)."""
        while self._released:
            region = self._released.pop()
            if self._fixed is None or self.fd < 0:
                continue
            slot = self._fixed.pop(region, None)
            if slot is None:
                continue
            with share.LOCK:
                share.forget(self, region)
            try:
                self._set_slot(slot, 0, 0)
            except OSError as exc:
                log.error("deepnvme: io_uring could not drop a registered buffer: %s", exc)
                continue
            self._free_slots.append(slot)
            if not self.plain:
                share.tidy_source()

    # --- submission ------------------------------------------------------------------------

    def prep(self, tag: int, write: bool, fd: int, address: int, length: int, offset: int,
             buf_index: int = -1) -> int:
        """Queue one read or write (from registered buffer ``buf_index`` if >= 0); returns the
        length queued (at most the kernel's maximum)."""
        length = min(length, _MAX_LEN)
        opcode = ((_OP_WRITE if write else _OP_READ) if buf_index < 0
                  else (_OP_WRITE_FIXED if write else _OP_READ_FIXED))
        _SQE.pack_into(self._sqes, (self._tail & self._sq_mask) * _SQE.size,
                       opcode, 0, 0, fd, offset, address, length, 0, tag, max(buf_index, 0))
        self._tail = (self._tail + 1) & 0xFFFFFFFF
        return length

    def prep_many(self, tags: list[int], write: bool, fd: int, addresses: list[int],
                  lengths: list[int], offsets: list[int], slots: list[int] | None) -> None:
        """Queue one read or write per ``tags[i]`` (as :meth:`prep`, on one descriptor, from
        registered buffer ``slots[i]`` where given and >= 0) in one call. Lengths above the
        kernel's maximum are queued capped: they complete short and are resubmitted."""
        if max(lengths) > _MAX_LEN:
            lengths = [min(n, _MAX_LEN) for n in lengths]
        plain = _OP_WRITE if write else _OP_READ
        fixed = _OP_WRITE_FIXED if write else _OP_READ_FIXED
        pack, sqes, mask, size, tail = _SQE.pack_into, self._sqes, self._sq_mask, _SQE.size, self._tail
        if slots is None:
            for tag, address, length, offset in zip(tags, addresses, lengths, offsets):
                pack(sqes, (tail & mask) * size, plain, 0, 0, fd, offset, address, length, 0, tag, 0)
                tail += 1
        else:
            for tag, address, length, offset, slot in zip(tags, addresses, lengths, offsets, slots):
                pack(sqes, (tail & mask) * size, plain if slot < 0 else fixed, 0, 0, fd, offset,
                     address, length, 0, tag, max(slot, 0))
                tail += 1
        self._tail = tail & 0xFFFFFFFF

    # --- tables: a batch's entries built in bulk, copied into the ring per round ------------

    def table(self, write: bool, fd: int, addresses: torch.Tensor, offsets: torch.Tensor,
              sizes: torch.Tensor) -> torch.Tensor:
        """The submission entries of reads (or writes) of ``sizes[i]`` bytes at ``offsets[i]``
        of ``fd`` into ``addresses[i]`` (1-D int64 tensors, sizes at most the kernel's maximum),
        tagged ``i``: an ``[n, 8]`` int64 tensor (64 bytes per entry), built with a fixed
        number of tensor operations; queue rows with :meth:`prep_rows`."""
        rows = torch.zeros((addresses.numel(), 8), dtype=torch.int64)
        rows[:, 0] = (_OP_WRITE if write else _OP_READ) | (fd << 32)
        rows[:, 1], rows[:, 2], rows[:, 3] = offsets, addresses, sizes
        torch.arange(addresses.numel(), out=rows[:, 4])
        return rows

    def set_row(self, table: torch.Tensor, i: int, address: int, length: int, offset: int) -> None:
        """Point row ``i`` of ``table`` at another range (a remainder to resubmit)."""
        table[i, 1], table[i, 2], table[i, 3] = offset, address, length

    def prep_rows(self, table: torch.Tensor, start: int, count: int) -> None:
        """Queue rows ``[start, start + count)`` of ``table`` (at most the free entries): one
        copy into the ring, two where it wraps."""
        first, src = self._tail & self._sq_mask, table.data_ptr() + start * _SQE.size
        k = min(count, self._sq_mask + 1 - first)
        ctypes.memmove(self._sqe_at + first * _SQE.size, src, k * _SQE.size)
        if k < count:
            ctypes.memmove(self._sqe_at, src + k * _SQE.size, (count - k) * _SQE.size)
        self._tail = (self._tail + count) & 0xFFFFFFFF

    def submit_and_wait(self, wait: int, single: bool = False) -> list[tuple[int, int]]:
        """Submit what :meth:`prep` queued and wait for at least ``wait`` completions (0: none);
        returns ``(tag, result)`` pairs, result being bytes moved or ``-errno``.

        ``single`` submits one entry per system call (DeepSpeed's ``single_submit``).
        """
        tags, results = self.submit_wait(wait, single)
        return list(zip(tags, results))

    def submit_wait(self, wait: int, most: int = 0) -> tuple[list[int], list[int]]:
        """:meth:`submit_and_wait` as two lists; at most ``most`` entries per call (0: all)."""
        if self._issuer is None:
            self._bind()
        elif self._released:
            self.tidy()
        self._sq[self._sq_tail] = self._tail
        while True:
            pending = (self._tail - self._sq[self._sq_head]) & 0xFFFFFFFF
            batch = min(pending, most) if most else pending
            last = batch == pending
            if _enter(_SYS_ENTER, self.fd, batch, wait if last else 0,
                      _ENTER_GETEVENTS if last and wait else 0, None, 0) < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                if err not in (errno.EAGAIN, errno.EBUSY):
                    raise OSError(err, os.strerror(err))
                # the kernel is short of resources: take completions and try again
                done = self._reap()
                if done[0]:
                    return done
                continue
            if last:
                return self._reap()

    def _bind(self) -> None:
        """Make the calling thread the ring's issuer (enabling a single-issuer ring)."""
        if self.single_issuer:
            syscall(_SYS_REGISTER, ctypes.c_uint(self.fd), ctypes.c_uint(_REGISTER_ENABLE_RINGS),
                    None, ctypes.c_uint(0))
        self._issuer = threading.get_ident()

    def _reap(self) -> tuple[list[int], list[int]]:
        cq, head = self._cq, self._cq[self._cq_head]
        tail = cq[self._cq_tail]
        if head == tail:
            return [], []
        first, n = head & self._cq_mask, (tail - head) & 0xFFFFFFFF
        # the entries [first, first + n) of the ring, in two pieces where they wrap
        end = min(first + n, self._cq_mask + 1)
        tags, res = self._cq_tags, self._cq_res
        out_tags, out_res = tags[2 * first:2 * end:2].tolist(), res[4 * first + 2:4 * end:4].tolist()
        if end - first < n:
            rest = n - (end - first)
            out_tags += tags[0:2 * rest:2].tolist()
            out_res += res[2:4 * rest:4].tolist()
        cq[self._cq_head] = tail  # the entries are read: the kernel may reuse them
        return out_tags, out_res

    def close(self) -> None:
        """Unmap the rings and close the ring's descriptor (pending entries must be reaped first)."""
        with self._fixed_lock:
            if self.fd < 0:
                return
            with share.LOCK:
                for region in self._fixed or ():
                    share.forget(self, region)
                self._fixed = None  # closing the ring drops every registration
        for view in (self._sq, self._cq, self._cq_tags, self._cq_res):
            view.release()
        del self._sqe_array  # the ctypes view exports the mapping: gone before it is closed
        for m in {id(self._sq_map): self._sq_map, id(self._cq_map): self._cq_map,
                  id(self._sqes): self._sqes}.values():
            m.close()
        os.close(self.fd)
        self.fd = -1
        if not self.plain:
            share.ring_closed()


def _setup(entries: int, params: bytearray, flags: int) -> int:
    """io_uring_setup with ``flags``; -1 where this kernel refuses them (EINVAL)."""
    params[:] = bytes(len(params))
    struct.pack_into("<I", params, 8, flags)
    buf = (ctypes.c_char * len(params)).from_buffer(params)
    try:
        return syscall(_SYS_SETUP, ctypes.c_uint(entries), buf)
    except OSError as exc:
        if not flags or exc.errno != errno.EINVAL:
            raise
        return -1
    finally:
        del buf


def probe_io_uring() -> str:
    """Set up and tear down a small ring; returns a description, raises ``OSError`` with why not."""
    q = UringQueue(4)
    try:
        return f"io_uring (ctypes on the system calls, {platform.machine()})"
    finally:
        q.close()
