"""``AioHandle``: tensor file I/O over the engine, futures first.

The futures API (``submit_read``/``submit_write``, ``read_many``/``write_many``) is defined
here; DeepSpeed's ``aio_handle`` method names come from a mixin
(:mod:`deepnvme.handles._deepspeed_methods`), so DeepSpeed users switch with one import.
Failures raise exceptions naming the file, offset and size. A handle is safe to share between
threads.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from ..config import IOConfig, resolve_config
from ..errors import DeepNVMeIOError, UnsupportedBufferError
from ..io.batch import Items, Summary, summarize
from ..io.engine import Engine, Transfer
from ..io.posix import Posix, current
from ..io.staging import CudaCopier, DeviceCopier, StagingPipeline
from ..io.striped import StripedIO
from ..io.volume import VolumePath
from ..memory.views import check_io_tensor
from ._deepspeed_methods import DeepSpeedMethods

__all__ = ["AioHandle", "wait_all"]

log = logging.getLogger(__name__)


class AioHandle(DeepSpeedMethods):
    """Asynchronous tensor file I/O: futures, batches of one file, and DeepSpeed's
    ``aio_handle`` methods, over one engine with its own worker threads.

    Buffers are contiguous tensors of any dtype; ``nbytes`` of the tensor is the transfer size.
    A buffer must stay untouched until its op completes (the handle keeps it alive until then).
    CPU tensors go to the engine directly; CUDA tensors go through a pipeline of pinned staging
    buffers (:mod:`deepnvme.io.staging`) with the same return values, futures and errors, and
    an op on one completes once its device copies are synchronised, so the data is ready on
    every stream.

    Args:
        block_size: bytes per chunk a request is cut into, each one system call (default
            1 MiB, as DeepSpeed's).
        queue_depth: chunks in flight per worker thread with ``io_uring``/``aio``; with
            ``threads``, the most chunks handed to all workers at once (default 128).
        single_submit: with ``io_uring``/``aio``, submit chunks one per system call instead
            of in batches (default False).
        overlap_events: accepted for DeepSpeed compatibility; every engine already overlaps
            submitting with completing, so it changes nothing.
        intra_op_parallelism: worker threads; one request's chunks are spread across all of
            them (default 1).
        engine: how chunks reach the kernel: ``"io_uring"``, ``"aio"``, ``"threads"``, or
            ``"auto"`` (the first of these this system runs, logging why it passed others).
        config: an :class:`~deepnvme.config.IOConfig` to start from; the arguments above that
            are not None override its fields. None: the arguments, then the ``DEEPNVME_*``
            environment, then the defaults.
        posix: the system-call layer, for tests that inject faults; None: the current one
            (:func:`deepnvme.io.posix.current`).

    Raises:
        ConfigError: a setting is out of range, or the named engine cannot run here (the
            message says why).

    Memory: the caller's buffers, plus bounce buffers only for memory O_DIRECT cannot use
    (see :mod:`deepnvme.config` for the bound), plus, from the first CUDA op, ``3 x
    (max(8 MiB, block_size x intra_op_parallelism) + alignment)`` pinned staging bytes.
    Striped files (``Volume`` paths) use one more engine per drive, each with these settings.
    Thread-safety: one handle may be shared between threads. Lifetime: :meth:`close` (or
    leaving a ``with`` block) waits for outstanding ops and stops the threads.
    """

    #: tensors on these device types are moved through pinned staging buffers
    _STAGED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)

    def __init__(self, block_size: int | None = None, queue_depth: int | None = None,
                 single_submit: bool | None = None, overlap_events: bool | None = None,
                 intra_op_parallelism: int | None = None, *, engine: str | None = None,
                 config: IOConfig | None = None, posix: Posix | None = None) -> None:
        explicit = {"block_size": block_size, "queue_depth": queue_depth,
                    "single_submit": single_submit, "overlap_events": overlap_events,
                    "intra_op_parallelism": intra_op_parallelism, "engine": engine}
        if config is not None:
            explicit = {k: v for k, v in explicit.items() if v is not None}
            self.config = config.replace(**explicit) if explicit else config
        else:
            self.config = resolve_config(explicit)
        self._engine = Engine(self.config, posix=posix if posix is not None else current())
        #: striped files (``Volume`` paths): one more engine per drive, made on first use
        self._striped = StripedIO(self.config, self._engine.posix)
        self._lock = threading.Lock()
        self._pending: list[Future[int]] = []
        self._staging_pipeline: StagingPipeline | None = None
        self._closed = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | IOConfig, **kwargs: Any) -> AioHandle:
        """Build from a DeepSpeed ``{"aio": {...}}`` dict (or its inner dict) or an IOConfig."""
        cfg = config if isinstance(config, IOConfig) else IOConfig.from_deepspeed(config)
        return cls(config=cfg, **kwargs)

    @property
    def engine(self) -> str:
        """The I/O engine in use ("io_uring", "aio" or "threads"; ``auto`` already resolved)."""
        return self._engine.name

    # --- the Pythonic surface: futures -----------------------------------------------------

    def submit_read(self, buffer: torch.Tensor, path: str | VolumePath, *, offset: int = 0,
                    validate: bool = False, keep_open: bool = False) -> Future[int]:
        """Start reading ``buffer.nbytes`` bytes at ``offset`` of ``path`` into ``buffer``.

        Returns a future of the byte count; the caller owns it (it is not counted by
        :meth:`wait`, which serves DeepSpeed's async calls). :meth:`close` still waits for it.
        ``keep_open`` (CPU buffers): keep the file's descriptors open for later requests that
        also ask for it, instead of opening and closing it per request; see :meth:`close_files`.
        """
        return self._submit(False, buffer, path, offset, validate, track=False,
                            keep_open=keep_open)

    def submit_write(self, buffer: torch.Tensor, path: str | int | VolumePath, *, offset: int = 0,
                     validate: bool = False, fsync: bool | None = None,
                     keep_open: bool = False) -> Future[int]:
        """Start writing ``buffer``'s bytes at ``offset`` of ``path`` (created if missing,
        never truncated), of an open file descriptor or of a striped file (a
        :class:`~deepnvme.Volume` path). ``fsync`` overrides the config's.
        Like :meth:`submit_read`, the future is the caller's and not counted by :meth:`wait`;
        ``keep_open`` as there."""
        return self._submit(True, buffer, path, offset, validate, fsync, track=False,
                            keep_open=keep_open)

    def read_many(self, path: str | os.PathLike[str] | VolumePath,
                  items: Sequence[tuple[torch.Tensor, int]], *, validate: bool = False,
                  keep_open: bool = False) -> Future[int]:
        """Start reading many ``(buffer, file_offset)`` items of one file, opened once.

        Items that are one aligned O_DIRECT chunk each are gathered many to a request; others
        are planned like any request (split into chunks); all are in flight together up to
        the window. The future's result is the total byte count, or the first failure once
        every item has ended. CPU buffers only. ``keep_open`` as in :meth:`submit_read`.
        """
        return self._submit_many(False, path, items, validate, None, keep_open)

    def write_many(self, path: str | os.PathLike[str] | VolumePath,
                   items: Sequence[tuple[torch.Tensor, int]], *, validate: bool = False,
                   fsync: bool | None = None, keep_open: bool = False) -> Future[int]:
        """Start writing many ``(buffer, file_offset)`` items into one file (created if missing,
        never truncated), opened once; ``fsync`` runs once after the last item. ``keep_open``
        as in :meth:`submit_read`."""
        return self._submit_many(True, path, items, validate, fsync, keep_open)

    def read_many_into(self, path: str | os.PathLike[str] | VolumePath, buffer: torch.Tensor, *,
                       buffer_offsets: torch.Tensor, file_offsets: torch.Tensor, sizes: torch.Tensor,
                       keep_open: bool = False) -> Future[int]:
        """Start reading many ranges of one file into one CPU ``buffer``, as :meth:`read_many`
        does: range ``k`` is ``sizes[k]`` bytes at ``file_offsets[k]`` of ``path``, landing at byte
        ``buffer_offsets[k]`` of ``buffer``. The three are 1-D integer tensors of one length
        (checked together, no Python object per range: for thousands of small reads); ``buffer``
        stays alive until the future completes. ValueError for a range outside ``buffer``.
        A :class:`~deepnvme.VolumePath` is read striped: each range's pieces from their drives."""
        target = path if isinstance(path, VolumePath) else os.fspath(path)
        if self._check_buffer(buffer):
            raise UnsupportedBufferError(f"read_many_into takes a CPU buffer; got one on {buffer.device}")
        at, off, size = (torch.as_tensor(t, dtype=torch.int64).reshape(-1)
                         for t in (buffer_offsets, file_offsets, sizes))
        if not at.numel() == off.numel() == size.numel():
            raise ValueError(f"buffer_offsets, file_offsets and sizes differ in length: "
                             f"{at.numel()}, {off.numel()}, {size.numel()}")
        # bounds in bulk: planning needs no loop per range where all are gathered
        summary, addresses, lowest, highest, absolute = (
            summarize(at, buffer.data_ptr(), off, size) if at.numel() else (None, [], 0, 0, at))
        if summary is not None and (lowest < 0 or summary.smallest < 0 or highest > buffer.nbytes):
            k = int(((at < 0) | (size < 0) | (at + size > buffer.nbytes)).nonzero()[0])
            raise ValueError(f"read_many_into({target!r}): range {k} ({int(size[k])} bytes at buffer byte "
                             f"{int(at[k])}) lies outside the {buffer.nbytes}-byte buffer")
        items = Items(addresses, size.tolist(), off.tolist(), buffer, summary, (absolute, off, size))
        if isinstance(target, VolumePath):  # split per drive (io.volume.split_ranges), read on all at once
            return self._striped.submit_many(False, target, items, keep_open=keep_open)
        return self._engine.submit_many(False, target, items, validate=False, fsync=None,
                                        keep_open=keep_open)

    def _read_planned(self, path: str, buffer: torch.Tensor, ranges: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                      bounds: tuple[int, int, int, int, int], reach: int, *, keep_open: bool) -> Future[int]:
        """:meth:`read_many_into` of ranges planned by deepnvme itself (the token reader), whose
        bounds need no second pass: ``ranges`` = buffer offsets (not negative), file offsets and
        sizes (1-D int64 tensors of one length, not empty); ``bounds`` = their lowest file offset,
        end, smallest and largest size, and a power of two dividing every offset and size, exact;
        none reaches past buffer byte ``reach``, checked here against ``buffer``. The engine still
        checks the file's size and every completion, as for any batch."""
        if self._check_buffer(buffer) or reach > buffer.nbytes:
            raise ValueError(f"_read_planned({path!r}): the ranges need a CPU buffer of {reach} bytes")
        at, off, size = ranges
        base = buffer.data_ptr()
        absolute = at + base
        lowest, end, smallest, largest, align = bounds
        summary = Summary(lowest, end, smallest, largest, align, min(align, base & -base))
        items = Items(absolute.tolist(), size.tolist(), off.tolist(), buffer, summary, (absolute, off, size))
        return self._engine.submit_many(False, path, items, validate=False, fsync=None, keep_open=keep_open)

    def close_files(self, paths: Iterable[str | os.PathLike[str] | VolumePath] = (), *,
                    under: str | os.PathLike[str] | None = None) -> None:
        """Close the descriptors kept open (``keep_open=True``) for ``paths`` and for every file
        under the directory ``under`` (one still in use closes when its requests end). Call it
        before deleting, renaming over or truncating such a file elsewhere: a kept descriptor
        keeps reaching the old file. :meth:`close` closes them all. At most a quarter of the
        process's descriptor limit (up to 4096) files stay open per handle; beyond it the least
        recently used idle one is closed. Raises the first close failure, naming the file."""
        plain = list(paths)
        striped = [p for p in plain if isinstance(p, VolumePath)]
        where = None if under is None else os.fspath(under)
        self._engine.close_files([os.fspath(p) for p in plain if not isinstance(p, VolumePath)],
                                 under=where)
        self._striped.close_files(striped, under=where)

    def _submit_many(self, write: bool, path: str | os.PathLike[str] | VolumePath,
                     items: Sequence[tuple[torch.Tensor, int]], validate: bool,
                     fsync: bool | None, keep_open: bool = False) -> Future[int]:
        target = path if isinstance(path, VolumePath) else os.fspath(path)
        if not isinstance(target, (str, VolumePath)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        # three lists of ints and a list of buffers, no object per item: see deepnvme.io.batch
        addresses: list[int] = []
        sizes: list[int] = []
        offsets: list[int] = []
        buffers: list[torch.Tensor] = []
        tensor_type = torch.Tensor
        for i, item in enumerate(items):
            try:
                buffer, offset = item
            except (TypeError, ValueError):
                raise TypeError(f"items[{i}] must be a (tensor, file_offset) pair, got "
                                f"{type(item).__name__}") from None
            # fast path for the common case; anything else gets the full check and its message
            if not (type(buffer) is tensor_type and buffer.is_cpu and buffer.is_contiguous()):
                if self._check_buffer(buffer):
                    raise UnsupportedBufferError(
                        f"items[{i}]: read_many/write_many take CPU tensors; got one on "
                        f"{buffer.device}: use submit_read/submit_write for device tensors")
            addresses.append(buffer.data_ptr())
            sizes.append(buffer.nbytes)
            offsets.append(int(offset))
            buffers.append(buffer)
        batch = Items(addresses, sizes, offsets, buffers)
        if isinstance(target, VolumePath):
            return self._striped.submit_many(write, target, batch, validate=validate,
                                             fsync=fsync, keep_open=keep_open)
        return self._engine.submit_many(write, target, batch, validate=validate, fsync=fsync,
                                        keep_open=keep_open)

    def _submit(self, write: bool, buffer: torch.Tensor, target: str | int | VolumePath,
                offset: int, validate: bool, fsync: bool | None = None, *, track: bool,
                keep_open: bool = False) -> Future[int]:
        staged = self._check_buffer(buffer)
        if isinstance(target, VolumePath):
            fut = self._submit_striped(write, buffer, target, int(offset), validate, fsync,
                                       staged, keep_open)
            if track:
                with self._lock:
                    self._pending.append(fut)
            return fut
        if staged and keep_open:
            raise UnsupportedBufferError(
                f"keep_open is for CPU buffers; this one is on {buffer.device} (staged requests "
                "open their file each time): pass keep_open=False")
        if hasattr(target, "__fspath__"):
            target = os.fspath(target)
        if isinstance(target, bool) or not isinstance(target, (str, int)):
            raise TypeError(f"file must be a path or a file descriptor, got {type(target).__name__}")
        if int(offset) < 0:
            raise DeepNVMeIOError("negative file offset", path=str(target), offset=offset,
                                  size=buffer.numel() * buffer.element_size())
        if staged:
            fut = self._staging().submit(buffer, target, write=write, offset=int(offset),
                                         validate=validate,
                                         fsync=self.config.fsync if fsync is None else fsync)
        else:
            fut = _submit_to(self._engine, write, buffer, target, int(offset), validate=validate,
                             fsync=fsync, keep_open=keep_open)
        if track:
            with self._lock:
                self._pending.append(fut)
        return fut

    def _submit_striped(self, write: bool, buffer: torch.Tensor, target: VolumePath, offset: int,
                        validate: bool, fsync: bool | None, staged: bool,
                        keep_open: bool) -> Future[int]:
        """A request on a striped file: CPU buffers as one batch over the drives' engines;
        device buffers through the staging pipeline, its chunks striped the same way."""
        size = buffer.numel() * buffer.element_size()
        if offset < 0:
            raise DeepNVMeIOError("negative file offset", path=str(target), offset=offset,
                                  size=size)
        if not staged:
            return self._striped.submit_many(
                write, target, Items([buffer.data_ptr()], [size], [offset], buffer),
                validate=validate, fsync=fsync, keep_open=keep_open)
        pipeline = self._staging()
        if not isinstance(pipeline, StagingPipeline):
            raise UnsupportedBufferError(
                f"{type(self).__name__} moves {buffer.device} tensors with cuFile, which takes "
                "plain files: use an AioHandle (or CPU tensors) for striped files")
        if write:  # grow the layout once, not per staged chunk
            self._striped.reserve(target, offset + size)
        return pipeline.submit(buffer, target, write=write, offset=offset, validate=validate,
                               fsync=self.config.fsync if fsync is None else fsync)

    def _check_buffer(self, buffer: object) -> bool:
        """Validate an I/O buffer; True if it goes through the staging pipeline."""
        if isinstance(buffer, torch.Tensor) and buffer.device.type in self._STAGED_DEVICE_TYPES:
            if not buffer.is_contiguous():
                raise UnsupportedBufferError(
                    f"buffer is not contiguous (shape {tuple(buffer.shape)}, stride "
                    f"{buffer.stride()}); call .contiguous() first")
            return True
        check_io_tensor(buffer)
        return False

    def _new_copier(self) -> DeviceCopier:
        return CudaCopier()

    def _staging_options(self) -> dict[str, int]:
        c = self.config
        return {"chunk_bytes": max(8 << 20, c.block_size * c.intra_op_parallelism),
                "buffers": 3, "alignment": c.alignment}

    def _staging(self) -> StagingPipeline:
        with self._lock:
            if self._staging_pipeline is None:
                if self._closed:
                    raise RuntimeError("this handle is closed; create a new one")
                # the pipeline holds the engine, not the handle: dropping the handle still
                # runs __del__ (which closes both) instead of leaving a reference cycle
                self._staging_pipeline = StagingPipeline(functools.partial(_submit_any, self._engine,
                                                                           self._striped),
                                                         self._new_copier(), **self._staging_options())
            return self._staging_pipeline

    def drain(self) -> None:
        """Block until every request submitted through this handle so far has ended, tracked
        or not (``submit_*``, ``*_many``, staged). Errors stay on their futures; raises nothing."""
        with self._lock:
            staging = self._staging_pipeline
        if staging is not None:
            staging.drain()
        self._engine.drain()
        self._striped.drain()

    def wait(self) -> int:
        """Block until all pending async ops finish; return how many completed since the last
        wait (0 if none). If any failed, raise the first failure after all have finished."""
        with self._lock:
            pending, self._pending = self._pending, []
        first: BaseException | None = None
        for fut in pending:
            exc = fut.exception()
            if exc is not None and first is None:
                first = exc
        if first is not None:
            raise first
        return len(pending)

    # --- lifetime --------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for outstanding ops, then stop the worker threads. Idempotent. Failures of ops
        nobody waited for are logged as errors (call :meth:`wait` first to get them raised)."""
        self._closed = True
        if self._staging_pipeline is not None:
            self._staging_pipeline.close()
        self._engine.close()
        self._striped.close()
        with self._lock:
            pending, self._pending = self._pending, []
        for fut in pending:
            exc = fut.exception()
            if exc is not None:
                log.error("deepnvme: async op failed and was never waited for: %s", exc)

    def __enter__(self) -> AioHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if exc[0] is None:
                self.wait()
        finally:
            self.close()

    def __del__(self) -> None:
        staging = getattr(self, "_staging_pipeline", None)
        if staging is not None:
            staging.close()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            engine.close()
        striped = getattr(self, "_striped", None)
        if striped is not None:
            striped.close()

    def __repr__(self) -> str:
        c = self.config
        return (f"AioHandle(engine={self.engine!r}, block_size={c.block_size}, "
                f"queue_depth={c.queue_depth}, "
                f"single_submit={c.single_submit}, overlap_events={c.overlap_events}, "
                f"intra_op_parallelism={c.intra_op_parallelism})")


def _submit_to(engine: Engine, write: bool, buffer: torch.Tensor, target: str | int, offset: int,
               *, validate: bool, fsync: bool | None, keep_open: bool = False) -> Future[int]:
    """Hand one contiguous CPU buffer to the engine (the staging pipeline's ``submit_io``)."""
    transfer = Transfer(write=write, address=buffer.data_ptr(),
                        size=buffer.numel() * buffer.element_size(),
                        target=target, file_offset=offset, keepalive=buffer)
    return engine.submit(transfer, validate=validate, fsync=fsync, keep_open=keep_open)


def _submit_any(engine: Engine, striped: StripedIO, write: bool, buffer: torch.Tensor,
                target: str | int | VolumePath, offset: int, *, validate: bool,
                fsync: bool | None, keep_open: bool = False) -> Future[int]:
    """The staging pipeline's ``submit_io``: a plain file to the engine, a striped one over
    the drives' engines."""
    if isinstance(target, VolumePath):
        size = buffer.numel() * buffer.element_size()
        return striped.submit_many(write, target, Items([buffer.data_ptr()], [size], [offset],
                                                        buffer),
                                   validate=validate, fsync=fsync, keep_open=keep_open)
    return _submit_to(engine, write, buffer, target, offset, validate=validate, fsync=fsync,
                      keep_open=keep_open)


def wait_all(futures: Iterable[Future[int] | None]) -> None:
    """Wait for every future (so no buffer is released while in flight); raise the first error."""
    first: BaseException | None = None
    for fut in futures:
        if fut is None:
            continue
        exc = fut.exception()
        if exc is not None and first is None:
            first = exc
    if first is not None:
        raise first
