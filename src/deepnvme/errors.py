"""The exception hierarchy: every I/O failure is an ``OSError`` that names the file, and the
offset and size of the failing transfer where there is one."""

from __future__ import annotations

import errno as _errno
import os
from collections.abc import Sequence
from typing import Any

__all__ = [
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "ConfigError",
    "DatasetFormatError",
    "DeepNVMeError",
    "DeepNVMeIOError",
    "DistributedSaveError",
    "FileNotFoundIOError",
    "GdsUnavailableError",
    "PermissionIOError",
    "RanksTimeoutError",
    "ShortTransferError",
    "SwapBufferError",
    "SwapError",
    "UnsupportedBufferError",
    "UsageError",
    "ValidationError",
    "VolumeLayoutError",
]


class DeepNVMeError(Exception):
    """Base class of every error deepnvme raises on purpose."""


class DeepNVMeIOError(DeepNVMeError, OSError):
    """An I/O request failed; carries ``path``, ``offset`` and ``size`` of the failing transfer.

    Each is None where it does not apply (an open, a directory); the message names only those
    that are known. ``errno`` is the operating system's code when there was one (``ENOSPC``,
    ``EIO`` ...), so ``except OSError`` and ``e.errno == errno.ENOSPC`` work as for any file
    error. ENOENT is raised as :class:`FileNotFoundIOError`, EACCES/EPERM as
    :class:`PermissionIOError` (also ``FileNotFoundError`` and ``PermissionError``).
    """

    def __init__(self, message: str, *, path: str | None, offset: int | None, size: int | None,
                 errno: int | None = None) -> None:
        detail = _with_location(message, path, offset, size)
        if errno is not None:
            super().__init__(errno, detail)
        else:
            super().__init__(detail)
        self.path = path
        self.offset = offset
        self.size = size

    def __reduce__(self):  # type: ignore[no-untyped-def]
        # keyword-only constructor: pickle (multiprocessing, torch.distributed) needs help
        return _rebuild, (type(self), self.args, self.__dict__)

    @classmethod
    def from_oserror(cls, exc: OSError, *, op: str, path: str | None, offset: int | None,
                     size: int | None) -> DeepNVMeIOError:
        """Wrap an ``OSError`` from a syscall, keeping its errno and naming the transfer.

        ENOENT and EACCES/EPERM give subclasses that are also ``FileNotFoundError`` and
        ``PermissionError``, so the usual ``except`` clauses keep working.
        """
        reason = exc.strerror or os.strerror(exc.errno or 0) or str(exc)
        target = _BY_ERRNO.get(exc.errno or 0, cls) if cls is DeepNVMeIOError else cls
        return target(f"{op} failed: {reason}", path=path, offset=offset, size=size, errno=exc.errno)


def _with_location(message: str, path: str | None, offset: int | None, size: int | None) -> str:
    """``message (file 'p', offset o, size s)`` naming only what is known."""
    known = [f"file {path!r}" if path is not None else "",
             f"offset {offset}" if offset is not None else "",
             f"size {size}" if size is not None else ""]
    where = ", ".join(part for part in known if part)
    return f"{message} ({where})" if where else message


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    err: BaseException = cls.__new__(cls, *args)
    OSError.__init__(err, *args)
    err.__dict__.update(state)
    return err


class FileNotFoundIOError(DeepNVMeIOError, FileNotFoundError):
    """A file or directory in the request does not exist (ENOENT)."""


class PermissionIOError(DeepNVMeIOError, PermissionError):
    """The file or directory may not be opened as asked (EACCES, EPERM)."""


_BY_ERRNO: dict[int, type[DeepNVMeIOError]] = {
    _errno.ENOENT: FileNotFoundIOError, _errno.EACCES: PermissionIOError,
    _errno.EPERM: PermissionIOError}


class ShortTransferError(DeepNVMeIOError):
    """A read hit end-of-file, or a write stopped, before the requested bytes were transferred."""

    def __init__(self, message: str, *, path: str | None, offset: int, size: int,
                 transferred: int) -> None:
        super().__init__(f"{message}: {transferred} of {size} bytes transferred",
                         path=path, offset=offset, size=size, errno=_errno.EIO)
        self.transferred = transferred

    @classmethod
    def past_end(cls, *, path: str | None, offset: int, size: int,
                 file_size: int) -> ShortTransferError:
        """The error for a read that would end past the end of the file (refused up front)."""
        return cls(f"read past end of file: the file has {file_size} bytes but the request "
                   f"ends at {offset + size}", path=path, offset=offset, size=size, transferred=0)


class ValidationError(DeepNVMeIOError):
    """``validate=True`` re-read the file and found bytes different from the buffer."""


class ConfigError(DeepNVMeError, ValueError):
    """A setting has a bad value or an unknown name."""


class CheckpointFormatError(DeepNVMeError, ValueError):
    """A checkpoint file is truncated, corrupted or not in the expected format."""


class DatasetFormatError(DeepNVMeError, ValueError):
    """A token dataset's ``.idx``/``.bin`` pair is truncated, inconsistent or not in Megatron's
    indexed-dataset format; the message names the file and the field."""


class CheckpointCorruptError(DeepNVMeError):
    """A stored checksum does not match the bytes read back, or a committed checkpoint is
    missing a file or has the wrong size; the message names the step and the tensor or file."""


class CheckpointLockedError(DeepNVMeError, RuntimeError):
    """Another live :class:`~deepnvme.CheckpointManager` is saving into the same directory."""


class CheckpointMismatchError(DeepNVMeError, ValueError):
    """A checkpoint's tensors do not fit the target: ``missing_keys`` and ``unexpected_keys``
    (names), ``mismatched`` ((name, file shape, target shape) triples), ``unconvertible``
    ((name, file dtype, target dtype) names that ``Tensor.copy_`` cannot convert); all listed at once."""

    def __init__(self, message: str, *, missing_keys: Sequence[str] = (),
                 unexpected_keys: Sequence[str] = (),
                 mismatched: Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
                 unconvertible: Sequence[tuple[str, str, str]] = ()) -> None:
        super().__init__(message)
        self.missing_keys = list(missing_keys)
        self.unexpected_keys = list(unexpected_keys)
        self.mismatched = list(mismatched)
        self.unconvertible = list(unconvertible)

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return _rebuild_plain, (type(self), self.args, self.__dict__)


def _rebuild_plain(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    err: BaseException = cls.__new__(cls, *args)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class UnsupportedBufferError(DeepNVMeError, TypeError):
    """A tensor cannot be used as an I/O buffer (non-contiguous, wrong device ...)."""


class SwapError(DeepNVMeIOError):
    """A swap read or write failed; names the key, the file, the offset and the size."""


class SwapBufferError(DeepNVMeError, RuntimeError):
    """The swap buffer pool cannot serve a request: a tensor larger than a buffer, or every
    buffer held by swapped-in keys that nobody released."""



class OffloadMemoryError(DeepNVMeError, RuntimeError):
    """Offloaded parameters and gradients cannot fit the memory budget: a module's parameters,
    or an optimizer sub-group's parameters and gradients, exceed it, or all of it is in use."""


class GdsUnavailableError(DeepNVMeError, RuntimeError):
    """GPUDirect Storage cannot run here (no CUDA device, no cuFile binding, driver open failed)."""


class DistributedSaveError(DeepNVMeError, RuntimeError):
    """A data-parallel save failed on at least one rank (the previous file is untouched)."""


class RanksTimeoutError(DeepNVMeError, TimeoutError):
    """Ranks of a multi-rank checkpoint manager did not reach one of its collectives in time (the
    message names them)."""


class UsageError(DeepNVMeError):
    """The command line asks for something this system cannot do; ``main`` prints it as one
    line and exits 2."""


class VolumeLayoutError(DeepNVMeIOError):
    """A striped file's layout records do not match the volume it is opened with (other
    drives, another order or stripe unit), or a drive, record or part is missing; ``path``
    names the drive's record or part file."""

    def __init__(self, message: str, *, path: str | None, errno: int | None = None) -> None:
        super().__init__(message, path=path, offset=None, size=None, errno=errno)
