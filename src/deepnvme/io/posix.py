"""The only module that makes file syscalls. Each call either finishes its transfer or raises.

:class:`Posix` is a plain object so tests can subclass it to inject short reads, ``EINTR``,
``ENOSPC`` or ``EIO``; the engine takes an instance and calls nothing else.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import ctypes.util
import errno
import fcntl
import os
from collections.abc import Callable, Iterator

from ..errors import DeepNVMeIOError, ShortTransferError
from .plan import Alignment

__all__ = ["MADV_DONTNEED", "MADV_POPULATE_READ", "Posix", "POSIX", "O_DIRECT", "evict_page_cache", "madvise",
           "resident_bytes", "syscall"]

O_DIRECT: int = getattr(os, "O_DIRECT", 0)
_AT_FDCWD = -100
_AT_EMPTY_PATH = 0x1000
_STATX_DIOALIGN = 0x2000
_STATX_BUF = 256
_DIO_MEM_OFF, _DIO_OFFSET_OFF = 152, 156  # offsets of stx_dio_mem_align / stx_dio_offset_align

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_statx = getattr(_libc, "statx", None)
if _statx is not None:
    _statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    _statx.restype = ctypes.c_int
_libc.syscall.restype = ctypes.c_long
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                       ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_LOW_BIT = bytes(i & 1 for i in range(256))  # mincore: bit 0 of each byte = page resident
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
_libc.fallocate.restype = ctypes.c_int
MADV_POPULATE_READ = 22  # Linux 5.14+: fault in a range as reads would, with an error instead of SIGBUS
MADV_DONTNEED = 4  # drop a range's pages from this mapping (a file's stay in the page cache)


def syscall(number: int, *args: object) -> int:
    """``syscall(2)`` through ctypes (the GIL is released for the call); raises ``OSError``."""
    result: int = _libc.syscall(ctypes.c_long(number), *args)
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def syscall_function(*argtypes: type) -> Callable[..., int]:
    """A ``syscall(2)`` entry with fixed argument types (the number first): calls with plain
    ints skip making a ctypes object per argument, for the per-batch calls of the kernel
    movers. Returns the raw result (-1 and ``ctypes.get_errno()`` on failure); the GIL is
    released for the call."""
    fn = _libc["syscall"]  # a new function object: its argtypes are its own
    fn.argtypes = [ctypes.c_long, *argtypes]
    fn.restype = ctypes.c_long
    return fn  # type: ignore[no-any-return,unused-ignore]


def madvise(addr: int, length: int, advice: int) -> None:
    """``madvise(2)`` on ``[addr, addr + length)`` (page-aligned ``addr``); the GIL is released
    for the call. Raises ``OSError`` with the call's errno."""
    if _libc.madvise(addr, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise: {os.strerror(err)}")


class Posix:
    """Blocking positional I/O on file descriptors (``os.preadv``/``os.pwritev`` release the GIL)."""

    def open(self, path: str, *, write: bool, direct: bool, offset: int | None = None,
             size: int | None = None, read_write: bool = False) -> int:
        """Open for reading, or for writing (created if missing, never truncated); with
        ``read_write`` for both (``O_RDWR``, created only if ``write``).

        ``offset``/``size`` only name the request in the error message.
        """
        if read_write:
            flags = os.O_CLOEXEC | os.O_RDWR | (os.O_CREAT if write else 0)
        else:
            flags = os.O_CLOEXEC | (os.O_WRONLY | os.O_CREAT if write else os.O_RDONLY)
        if direct:
            flags |= O_DIRECT
        try:
            return os.open(path, flags, 0o644)
        except OSError as exc:
            raise DeepNVMeIOError.from_oserror(
                exc, op="open for " + ("read and write" if read_write else "write" if write else "read")
                + (" (O_DIRECT)" if direct else ""),
                path=path, offset=offset, size=size) from None

    def close(self, fd: int) -> None:
        os.close(fd)

    def preadv(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return os.preadv(fd, buffers, offset)

    def pwritev(self, fd: int, buffers: list[memoryview], offset: int) -> int:
        return os.pwritev(fd, buffers, offset)

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def file_size(self, fd: int) -> int:
        return os.fstat(fd).st_size

    def link_count(self, fd: int) -> int:
        """Names the open file has; 0 once it was deleted or replaced (renamed over)."""
        return os.fstat(fd).st_nlink

    def fallocate(self, fd: int, offset: int, length: int) -> bool:
        """Reserve blocks for ``[offset, offset + length)``; False where the filesystem cannot.

        Raises OSError (ENOSPC ...) for real failures.
        """
        try:
            os.posix_fallocate(fd, offset, length)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return False
            raise
        return True

    def extend(self, fd: int, offset: int, length: int) -> int:
        """Allocate ``[offset, offset + length)`` and grow the file's size to its end
        (``fallocate(2)`` mode 0: never shrinks, never writes data, no emulation); 0 on
        success, else the errno (EOPNOTSUPP where the filesystem cannot). Why: an O_DIRECT
        write past the end of the file is synchronous in Linux AIO and punted to kernel
        workers by io_uring; inside the file's size both queue it."""
        if _libc.fallocate(fd, 0, offset, length) == 0:
            return 0
        return ctypes.get_errno() or errno.EIO

    def is_direct(self, fd: int) -> bool:
        return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & O_DIRECT) if O_DIRECT else False

    def dio_alignment(self, fd: int) -> Alignment | None:
        """The fd's O_DIRECT alignment from statx(STATX_DIOALIGN), or None where not reported.

        Raises ``OSError(EINVAL)`` when the kernel reports that the file supports no O_DIRECT.
        """
        if _statx is None:
            return None
        buf = ctypes.create_string_buffer(_STATX_BUF)
        if _statx(fd, b"", _AT_EMPTY_PATH, _STATX_DIOALIGN, buf) != 0:
            return None
        mask = int.from_bytes(buf.raw[0:4], "little")
        if not mask & _STATX_DIOALIGN:
            return None
        mem = int.from_bytes(buf.raw[_DIO_MEM_OFF:_DIO_MEM_OFF + 4], "little")
        off = int.from_bytes(buf.raw[_DIO_OFFSET_OFF:_DIO_OFFSET_OFF + 4], "little")
        if off == 0 or mem == 0:
            raise OSError(errno.EINVAL, "file does not support O_DIRECT (statx dio_offset_align=0)")
        return Alignment(memory=mem, offset=off)

    # --- loops that finish the transfer or raise -------------------------------------------

    def read_fully(self, fd: int, view: memoryview, offset: int, *, path: str | None) -> None:
        """Fill ``view`` from ``offset``; EOF before the end raises :class:`ShortTransferError`."""
        self._fully(False, fd, view, offset, path)

    def write_fully(self, fd: int, view: memoryview, offset: int, *, path: str | None) -> None:
        """Write all of ``view`` at ``offset``; a write that makes no progress raises."""
        self._fully(True, fd, view, offset, path)

    def _fully(self, write: bool, fd: int, view: memoryview, offset: int, path: str | None) -> None:
        call, what = (self.pwritev, "write") if write else (self.preadv, "read")
        stalled = "write made no progress" if write else "unexpected end of file"
        size, done = len(view), 0
        while done < size:
            try:
                n = call(fd, [view[done:]], offset + done)
            except InterruptedError:
                continue
            except OSError as exc:
                raise DeepNVMeIOError.from_oserror(exc, op=what, path=path, offset=offset,
                                                   size=size) from None
            if n <= 0:
                raise ShortTransferError(stalled, path=path, offset=offset, size=size,
                                         transferred=done)
            done += n
            # O_DIRECT reads stop short at EOF, and a retry at an unaligned offset would fail
            # with EINVAL: name the real cause instead.
            if (not write and done < size and self.is_direct(fd)
                    and offset + done >= self.file_size(fd)):
                raise ShortTransferError(stalled, path=path, offset=offset, size=size,
                                         transferred=done)


POSIX = Posix()


def evict_page_cache(path: str) -> None:
    """Flush ``path`` to stable storage and drop its pages from the page cache, so the next
    buffered read comes from the device (how benchmarks make reads cold without O_DIRECT)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_bytes(path: str) -> int:
    """Bytes of ``path`` now in the page cache (whole pages, at most the file's size), from
    ``mincore(2)`` over a read-only mapping; touches no page. Raises ``OSError``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0
        addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        if addr is None or addr == ctypes.c_void_p(-1).value:
            raise OSError(ctypes.get_errno(), f"mmap: {os.strerror(ctypes.get_errno())}", path)
    finally:
        os.close(fd)
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        vec = (ctypes.c_ubyte * (-(-size // page)))()
        if _libc.mincore(addr, size, vec) != 0:
            raise OSError(ctypes.get_errno(), f"mincore: {os.strerror(ctypes.get_errno())}", path)
    finally:
        _libc.munmap(addr, size)
    return min(size, bytes(vec).translate(_LOW_BIT).count(1) * page)


_CURRENT: contextvars.ContextVar[Posix] = contextvars.ContextVar("deepnvme_posix", default=POSIX)


def current() -> Posix:
    """The syscall layer new handles use in this context: :data:`POSIX` unless :func:`injected`."""
    return _CURRENT.get()


@contextlib.contextmanager
def injected(posix: Posix) -> Iterator[Posix]:
    """Make handles created inside the ``with`` block (in this thread or task) use ``posix``:
    the seam through which tests fake short transfers, EINTR, EAGAIN and ENOSPC."""
    token = _CURRENT.set(posix)
    try:
        yield posix
    finally:
        _CURRENT.reset(token)
