"""The cuFile mover: device memory <-> files with ``cuFileRead``/``cuFileWrite``, under the engine.

:class:`CuFileMover` only issues chunks: the engine (:mod:`deepnvme.io.engine`) opens the file,
plans ``block_size`` chunks, keeps the window, the first error, fsync, validation and close. Per
request the mover registers a cuFile handle on the request's descriptor (its session,
deregistered before the descriptor closes); per chunk, on a worker thread, it makes the
tensor's device current, waits for the caller's stream work captured at submission, and calls
the binding with the base and offset of a registered buffer where the chunk lies inside one.

Nothing here imports the binding: the caller passes the loaded ``cuda.bindings.cufile`` module
(or a fake). Memory: no bounce buffers of our own (cuFile's are set in cufile.json); at most
``queue_depth`` chunks are handed to ``intra_op_parallelism`` threads; validation copies 8 MiB
of device memory to the host at a time.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import operator
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from ..config import IOConfig
from ..errors import DeepNVMeIOError, ShortTransferError
from ..memory.views import byte_view, cast_to_byte_tensor
from .engine import Engine
from .op import Op, Transfer
from .plan import Chunk
from .posix import POSIX, Posix

__all__ = [
    "BufferRegistry",
    "CuFileIO",
    "CuFileMover",
    "CudaOrder",
    "DeviceOrder",
    "DeviceTransfer",
    "counted_binding",
]

log = logging.getLogger(__name__)

_CU_FILE_OP_ERROR_BASE = 5000  # CUfileOpError codes start here; cuFileRead/Write return -code


class DeviceOrder(Protocol):
    """Stream ordering and device selection for device tensors (tests use a CPU fake).

    Call order per request: :meth:`begin` on the submitting thread; then, per chunk on a worker
    thread, :meth:`ready` inside :meth:`guard`.
    """

    def begin(self, tensor: torch.Tensor) -> Any:
        """Capture the work queued so far on the caller's current stream (a ticket)."""
        ...

    def ready(self, ticket: Any) -> None:
        """Block until the work behind ``ticket`` is done."""
        ...

    def guard(self, tensor: torch.Tensor) -> contextlib.AbstractContextManager[Any]:
        """Make the tensor's device (and its primary context) current on this thread."""
        ...


class CudaOrder:
    """:class:`DeviceOrder` for CUDA: a ticket is an event recorded on the current stream."""

    def begin(self, tensor: torch.Tensor) -> Any:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(tensor.device))
        return event

    def ready(self, ticket: Any) -> None:
        ticket.synchronize()

    @contextlib.contextmanager
    def guard(self, tensor: torch.Tensor) -> Iterator[None]:
        with torch.cuda.device(tensor.device):
            torch.cuda.set_device(tensor.device)
            yield


class BufferRegistry:
    """Device ranges registered with ``cuFileBufRegister``: base address -> length (bytes).
    Thread-safe."""

    def __init__(self) -> None:
        self._ranges: dict[int, int] = {}
        self._lock = threading.Lock()

    def add(self, base: int, length: int) -> None:
        with self._lock:
            self._ranges[base] = length

    def pop(self, base: int) -> int | None:
        with self._lock:
            return self._ranges.pop(base, None)

    def locate(self, address: int, length: int) -> tuple[int, int]:
        """(base, offset) to pass cuFile: inside a registered range, or (address, 0)."""
        with self._lock:
            for base, size in self._ranges.items():
                if base <= address and address + length <= base + size:
                    return base, address - base
        return address, 0

    def bases(self) -> list[int]:
        with self._lock:
            return list(self._ranges)


class DeviceTransfer(Transfer):
    """A :class:`Transfer` of a contiguous device tensor's bytes, with its ordering ticket.

    It has no host byte :attr:`view`; :meth:`buffer_bytes` copies device memory to the host.
    """

    __slots__ = ("order", "tensor", "ticket")

    def __init__(self, tensor: torch.Tensor, *, write: bool, target: str | int,
                 file_offset: int, ticket: Any, order: DeviceOrder) -> None:
        super().__init__(write=write, address=tensor.data_ptr(),
                         size=tensor.numel() * tensor.element_size(), target=target,
                         file_offset=file_offset, keepalive=tensor)
        self.tensor, self.ticket, self.order = tensor, ticket, order

    @property
    def view(self) -> memoryview:
        raise TypeError("a DeviceTransfer has no host byte view; use buffer_bytes()")

    def buffer_bytes(self, start: int, length: int) -> bytes:
        with self.order.guard(self.tensor):
            part = cast_to_byte_tensor(self.tensor.detach())[start:start + length]
            host = part.cpu()  # kept alive while bytes() copies it (no NumPy needed)
            return bytes(byte_view(host))


class _Session:
    """One request's cuFile file handle (and the descriptor struct it was registered from)."""

    __slots__ = ("cufile", "descr", "fh", "transfer")

    def __init__(self, cufile: Any, fh: Any, descr: Any, transfer: Transfer) -> None:
        self.cufile, self.fh, self.descr, self.transfer = cufile, fh, descr, transfer

    def close(self) -> None:
        t = self.transfer
        try:
            self.cufile.handle_deregister(self.fh)
        except Exception as exc:
            raise _wrap(exc, "cuFileHandleDeregister", t, t.file_offset, t.size) from exc


class CuFileMover:
    """The engine's :class:`~deepnvme.io.movers.Mover` for :class:`DeviceTransfer` requests
    over the cuFile binding ``cufile``; ``registry`` holds the registered device buffers.
    Thread-safe: the binding's calls are synchronous and release the GIL."""

    name = "cufile"

    def __init__(self, cufile: Any, registry: BufferRegistry) -> None:
        self.cufile, self.registry = cufile, registry

    def open_session(self, op: Op) -> _Session:
        t = op.transfer
        descr = self.cufile.Descr()
        descr.type = self.cufile.FileHandleType.OPAQUE_FD
        descr.handle.fd = op.fd_direct if op.fd_direct >= 0 else op.fd_buffered
        descr.fs_ops = 0
        try:
            fh = self.cufile.handle_register(descr.ptr)
        except Exception as exc:
            raise _wrap(exc, "cuFileHandleRegister", t, t.file_offset, t.size) from exc
        return _Session(self.cufile, fh, descr, t)

    def run_chunk(self, op: Op, chunk: Chunk) -> None:
        if op.stopped:
            return
        t = op.transfer
        if not isinstance(t, DeviceTransfer) or not isinstance(op.session, _Session):
            op.fail(TypeError("the cufile mover runs DeviceTransfer requests only"))
            return
        try:
            with t.order.guard(t.tensor):
                t.order.ready(t.ticket)  # the caller's stream work on the tensor is done
                self._move(op.session.fh, t, chunk)
        except BaseException as exc:  # noqa: BLE001 - recorded on the request, never lost
            op.fail(exc)

    def _move(self, fh: Any, t: Transfer, chunk: Chunk) -> None:
        size, offset = chunk.length, chunk.file_offset
        base, buf_offset = self.registry.locate(t.address + chunk.buf_offset, size)
        call, what = (self.cufile.write, "cuFileWrite") if t.write else (self.cufile.read,
                                                                        "cuFileRead")
        try:
            done = call(fh, base, size, offset, buf_offset)
        except Exception as exc:
            raise _wrap(exc, what, t, offset, size) from exc
        _check_count(done, what, t, offset, size)


def _check_count(result: Any, what: str, t: Transfer, offset: int, size: int) -> None:
    """Check the binding's return value for one call of ``size`` bytes.

    ``cuda.bindings.cufile`` (12.9.1 to 13.x) raises ``cuFileError`` when the C call returns
    -1 and returns None otherwise, dropping the count: then nothing more can be checked (reads
    past the end of the file are refused before any chunk runs). A binding that returns the
    count is checked fully: negative (-1 with errno, or -CUfileOpError) fails, short fails.
    """
    if result is None:
        return
    try:
        done = operator.index(result)
    except TypeError:
        done = size + 1
    if done > size:
        raise DeepNVMeIOError(f"{what} returned {result!r} for {size} bytes", path=t.name,
                              offset=offset, size=size, errno=errno.EIO)
    if done < 0:
        code = -done
        detail = f" (CUfileOpError {code})" if code >= _CU_FILE_OP_ERROR_BASE else ""
        raise DeepNVMeIOError(f"{what} failed: returned {done}{detail}", path=t.name,
                              offset=offset, size=size, errno=errno.EIO)
    if done < size:
        raise ShortTransferError("short write" if t.write else "unexpected end of file",
                                 path=t.name, offset=offset, size=size, transferred=done)


def _wrap(exc: BaseException, call: str, t: Transfer, offset: int, size: int
          ) -> DeepNVMeIOError:
    """The binding's exception as a DeepNVMeIOError naming the transfer. Its ``cuFileError``
    carries ``status``: a CUfileOpError code (>= 5000), or errno after a C return of -1."""
    if isinstance(exc, DeepNVMeIOError):
        return exc
    status = getattr(exc, "status", None)
    code = (exc.errno if isinstance(exc, OSError) and exc.errno else
            status if isinstance(status, int) and 0 < status < _CU_FILE_OP_ERROR_BASE else
            errno.EIO)
    return DeepNVMeIOError(f"{call} failed: {exc}", path=t.name, offset=offset, size=size,
                           errno=code)


class _CountedCalls:
    """The binding with ``read``/``write`` replaced by direct calls of ``cuFileRead`` and
    ``cuFileWrite`` that return their ``ssize_t`` result (the binding drops it); every other
    attribute is the binding's. A result of -1 raises ``OSError`` with the call's errno."""

    def __init__(self, binding: Any, lib: ctypes.CDLL) -> None:
        self._binding = binding
        self._calls: dict[str, Any] = {}
        for name in ("cuFileRead", "cuFileWrite"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64,
                           ctypes.c_int64]
            fn.restype = ctypes.c_ssize_t
            self._calls[name] = fn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._binding, name)

    def _call(self, name: str, fh: int, base: int, size: int, offset: int, buf_offset: int) -> int:
        done = int(self._calls[name](fh, base, size, offset, buf_offset))
        if done == -1:
            code = ctypes.get_errno() or errno.EIO
            raise OSError(code, f"{name}: {os.strerror(code)}")
        return done

    def read(self, fh: int, base: int, size: int, offset: int, buf_offset: int) -> int:
        return self._call("cuFileRead", fh, base, size, offset, buf_offset)

    def write(self, fh: int, base: int, size: int, offset: int, buf_offset: int) -> int:
        return self._call("cuFileWrite", fh, base, size, offset, buf_offset)


def _load_libcufile() -> ctypes.CDLL:
    """libcufile as the binding loaded it: by soname (already in the process once the driver is
    open), else where NVIDIA's path finder puts the wheel's copy."""
    try:
        return ctypes.CDLL("libcufile.so.0", use_errno=True)
    except OSError as first:
        try:
            from cuda.pathfinder import load_nvidia_dynamic_lib  # type: ignore[import-not-found,unused-ignore]
            return ctypes.CDLL(load_nvidia_dynamic_lib("cufile").abs_path, use_errno=True)
        except Exception as exc:  # noqa: BLE001 - the caller logs why counts stay invisible
            raise OSError(f"{first}; path finder: {exc}") from None


def counted_binding(binding: Any, *, load: Any = _load_libcufile) -> Any:
    """``binding`` with read/write results visible, so short and failed transfers are errors.

    ``cuda.bindings.cufile`` returns None from ``read``/``write`` where the C calls return the
    byte count. If libcufile cannot be loaded
    here the binding is kept and a warning says that short transfers go unseen."""
    try:
        return _CountedCalls(binding, load())
    except (OSError, AttributeError) as exc:
        log.warning("deepnvme: cuFile byte counts are not visible (%s): a short cuFileRead/"
                    "cuFileWrite cannot be detected on this machine", exc)
        return binding


class CuFileIO:
    """Device tensors <-> files through an :class:`Engine` with the cuFile mover: the route
    :class:`~deepnvme.handles.gds.GdsHandle` takes for CUDA tensors. Same ``submit``/``close`` as
    :class:`~deepnvme.io.staging.StagingPipeline`, so the handle treats both alike. It only
    builds requests; the engine coordinates them. Thread-safe."""

    def __init__(self, config: IOConfig, cufile: Any, order: DeviceOrder,
                 registry: BufferRegistry, *, posix: Posix = POSIX) -> None:
        self.order = order
        self.engine = Engine(config, posix=posix, mover=CuFileMover(cufile, registry))

    def submit(self, tensor: torch.Tensor, target: str | int, *, write: bool, offset: int = 0,
               validate: bool = False, fsync: bool = False) -> Future[int]:
        """Start moving all of contiguous ``tensor``; the future's result is the byte count.
        The transfer is ordered after the work queued on the caller's current stream; errors
        go to the future."""
        try:
            ticket = self.order.begin(tensor)
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the future
            failed: Future[int] = Future()
            failed.set_exception(exc)
            return failed
        transfer = DeviceTransfer(tensor, write=write, target=target, file_offset=offset,
                                  ticket=ticket, order=self.order)
        return self.engine.submit(transfer, validate=validate, fsync=fsync)

    def close(self) -> None:
        """Refuse new requests, finish the admitted ones, stop the threads. Idempotent."""
        self.engine.close()
