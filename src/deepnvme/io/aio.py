"""Linux AIO (``io_setup``/``io_submit``/``io_getevents``) through ctypes: no libaio, no compile.

One :class:`AioQueue` is one kernel AIO context used by one worker thread. The control blocks
live in one ctypes buffer (slot = tag), so their addresses stay valid while the kernel holds
them; ctypes releases the GIL for every system call. With O_DIRECT descriptors the kernel
queues the transfers; with buffered ones ``io_submit`` does them before it returns (still
correct, only not asynchronous, as with DeepSpeed's libaio engine).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
from typing import Any

import torch

from .posix import syscall, syscall_function

__all__ = ["AioQueue", "probe_aio"]

# io_setup, io_destroy, io_submit, io_getevents
_NUMBERS = {"x86_64": (206, 207, 209, 208), "aarch64": (0, 1, 2, 4), "arm64": (0, 1, 2, 4)}
_CMD_PREAD, _CMD_PWRITE = 0, 1
_MAX_LEN = 0x7FFFF000
# struct iocb (64 bytes, little-endian): data, key, rw_flags, opcode, reqprio, fd, buf, nbytes, offset
_IOCB = struct.Struct("<QIiHhIQQq16x")
_EVENT = struct.Struct("<QQqq")  # data, obj, res, res2
# typed once: io_submit(ctx, nr, iocb pointers), io_getevents(ctx, min, max, events, timeout)
_submit_call = syscall_function(ctypes.c_ulong, ctypes.c_long, ctypes.c_void_p)
_getevents_call = syscall_function(ctypes.c_ulong, ctypes.c_long, ctypes.c_long, ctypes.c_void_p,
                                   ctypes.c_void_p)


def _numbers() -> tuple[int, int, int, int]:
    machine = platform.machine()
    if machine not in _NUMBERS:
        raise OSError(errno.ENOSYS, f"Linux AIO system call numbers unknown for {machine}")
    return _NUMBERS[machine]


class AioQueue:
    """One AIO context of ``depth`` slots: :meth:`prep` queues, :meth:`submit_and_wait` runs.

    Not thread-safe: each worker owns its own queue. Raises ``OSError`` from the constructor
    where Linux AIO is unavailable (ENOSYS, or EAGAIN when fs.aio-max-nr is exhausted).
    """

    name = "aio"
    #: the chunk worker waits for a quarter of its chunks in flight per call: the kernel copies
    #: each completion out as it comes, so the thread returns to Python once per several chunks,
    #: not once per chunk (2026-12-06 log: 1 MiB chunks, RAM device, 0.058 -> 0.040 CPU-s/GB)
    wait_share = 4
    #: small reads wait for one completion per call (a larger minimum measured no fewer calls,
    #: 18-21 events each, and fewer IOPS: 2026-11-27 log)
    small_wait_share = 1 << 30

    def __init__(self, depth: int) -> None:
        self._setup, self._destroy, self._submit, self._getevents = _numbers()
        self.depth = max(1, depth)
        ctx = ctypes.c_ulong(0)
        syscall(self._setup, ctypes.c_uint(self.depth), ctypes.byref(ctx))
        self._ctx = ctx
        self._iocbs = ctypes.create_string_buffer(_IOCB.size * self.depth)
        self._base = ctypes.addressof(self._iocbs)
        self._ptrs: Any = (ctypes.c_void_p * self.depth)()  # takes a list of ints
        self._iocb_at = [self._base + tag * _IOCB.size for tag in range(self.depth)]
        self._events = ctypes.create_string_buffer(_EVENT.size * self.depth)
        self._event_words = memoryview(self._events).cast("B").cast("q")  # 4 per event
        self._queued: list[int] = []  # addresses of the control blocks to submit
        self._inflight = 0

    def fixed_slot(self, address: int, length: int) -> int:
        """Linux AIO has no registered buffers: always -1."""
        return -1

    def prep(self, tag: int, write: bool, fd: int, address: int, length: int, offset: int,
             buf_index: int = -1) -> int:
        """Queue one read or write (``tag`` < depth); returns the length queued."""
        length = min(length, _MAX_LEN)
        _IOCB.pack_into(self._iocbs, tag * _IOCB.size, tag, 0, 0,
                        _CMD_PWRITE if write else _CMD_PREAD, 0, fd, address, length, offset)
        self._queued.append(self._iocb_at[tag])
        return length

    def prep_many(self, tags: list[int], write: bool, fd: int, addresses: list[int],
                  lengths: list[int], offsets: list[int], slots: list[int] | None) -> None:
        """Queue one read or write per ``tags[i]`` on one descriptor, as :meth:`prep` does
        (``slots`` is ignored: no registered buffers)."""
        if max(lengths) > _MAX_LEN:
            lengths = [min(n, _MAX_LEN) for n in lengths]
        pack, iocbs, size = _IOCB.pack_into, self._iocbs, _IOCB.size
        cmd = _CMD_PWRITE if write else _CMD_PREAD
        for tag, address, length, offset in zip(tags, addresses, lengths, offsets):
            pack(iocbs, tag * size, tag, 0, 0, cmd, 0, fd, address, length, offset)
        at = self._iocb_at
        self._queued += [at[tag] for tag in tags]

    def table(self, write: bool, fd: int, addresses: torch.Tensor, offsets: torch.Tensor,
              sizes: torch.Tensor) -> torch.Tensor:
        """The control blocks of reads (or writes) of ``sizes[i]`` bytes at ``offsets[i]`` of
        ``fd`` into ``addresses[i]`` (1-D int64 tensors), tagged ``i``: an ``[n, 8]`` int64
        tensor (64 bytes each) that the kernel reads in place at submission, built with a fixed
        number of tensor operations; queue rows with :meth:`prep_rows`."""
        rows = torch.zeros((addresses.numel(), 8), dtype=torch.int64)
        torch.arange(addresses.numel(), out=rows[:, 0])
        rows[:, 2] = (_CMD_PWRITE if write else _CMD_PREAD) | (fd << 32)
        rows[:, 3], rows[:, 4], rows[:, 5] = addresses, sizes, offsets
        return rows

    def set_row(self, table: torch.Tensor, i: int, address: int, length: int, offset: int) -> None:
        """Point row ``i`` of ``table`` at another range (a remainder to resubmit)."""
        table[i, 3], table[i, 4], table[i, 5] = address, length, offset

    def prep_rows(self, table: torch.Tensor, start: int, count: int) -> None:
        """Queue rows ``[start, start + count)`` of ``table``, which must stay alive and
        unchanged until they are submitted (at most ``depth`` in flight)."""
        first = table.data_ptr() + start * _IOCB.size
        self._queued += range(first, first + count * _IOCB.size, _IOCB.size)

    def tidy(self) -> bool:
        """Nothing to drop (no registered buffers): False."""
        return False

    def submit_and_wait(self, wait: int, single: bool = False) -> list[tuple[int, int]]:
        """Submit what :meth:`prep` queued, wait for at least ``wait`` completions, return
        ``(tag, result)`` pairs (bytes moved or ``-errno``). ``single``: one per call."""
        tags, results = self.submit_wait(wait, single)
        return list(zip(tags, results))

    def submit_wait(self, wait: int, most: int = 0) -> tuple[list[int], list[int]]:
        """:meth:`submit_and_wait` with the tags and the results as two lists; at most
        ``most`` entries per system call (0: all at once; 1 or True: ``single_submit``)."""
        queued, ptrs = self._queued, self._ptrs
        while queued:
            n = min(len(queued), most) if most else len(queued)
            ptrs[:n] = queued[:n]
            done = _submit_call(self._submit, self._ctx.value, n, ptrs)
            if done < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                if err != errno.EAGAIN or not self._inflight:
                    raise OSError(err, os.strerror(err))
                done = 0
            del queued[:done]
            self._inflight += done
            if queued and not done:  # out of kernel resources: complete something first
                return self._wait(1)
        return self._wait(wait)

    def _wait(self, wait: int) -> tuple[list[int], list[int]]:
        if not self._inflight:
            return [], []
        while True:
            got = _getevents_call(self._getevents, self._ctx.value, min(wait, self._inflight),
                                  self.depth, self._events, None)
            if got >= 0:
                break
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise OSError(err, os.strerror(err))
        self._inflight -= got
        words = self._event_words  # data (the tag) and res of each event, as two strided views
        return words[0:4 * got:4].tolist(), words[2:4 * got:4].tolist()

    def close(self) -> None:
        """Destroy the context (pending entries must be reaped first)."""
        self._event_words.release()
        if self._ctx.value:
            syscall(self._destroy, self._ctx)
            self._ctx = ctypes.c_ulong(0)


def probe_aio() -> str:
    """Set up and destroy a small context; returns a description, raises ``OSError`` if not."""
    q = AioQueue(4)
    try:
        return "Linux AIO (ctypes on io_setup/io_submit/io_getevents, no libaio)"
    finally:
        q.close()
