"""torch.distributed.checkpoint storage with the deepnvme engine underneath.

:class:`NVMeStorageWriter` and :class:`NVMeStorageReader` are PyTorch's own
``FileSystemWriter``/``FileSystemReader`` (same planners, same file format, same
``.metadata``), so checkpoints stay readable by stock DCP; the byte movement changes, and each
save names its data files afresh so that saving over a checkpoint is all-or-nothing:

* writes: each data file is assembled in memory by DCP's serializer, then written with
  parallel O_DIRECT I/O to a temporary name, fsynced and atomically renamed (the directory
  fsynced too). Memory bound: one data file per writer thread.
* reads: when DCP opens a data file, every byte range the load plan needs from it is read in
  parallel into aligned buffers; DCP then deserializes each item from memory.

Use with ``dcp.save(state, storage_writer=NVMeStorageWriter(path))`` and
``dcp.load(state, storage_reader=NVMeStorageReader(path))`` on every rank.
"""

from __future__ import annotations

import dataclasses
import io
import os
import secrets
import threading
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from ..config import IOConfig, checkpoint_config
from ..handles.aio import AioHandle
from ..io import durable
from ..memory.views import aligned_empty, byte_view

__all__ = ["NVMeStorageWriter", "NVMeStorageReader"]


class _DurableWriteStream(io.BytesIO):
    """Collects one file in memory; ``close()`` writes it with the engine, durably and atomically."""

    def __init__(self, fs: _EngineFileSystem, path: str) -> None:
        super().__init__()
        self._fs = fs
        self._path = path
        self._finished = False  # committed, failed or aborted: close() never writes again

    def abort(self) -> None:
        """Discard what was written: nothing reaches the disk (a no-op after close())."""
        if self._finished:  # a failed close() is unwinding: its error must reach the caller
            return
        self._finished = True
        super().close()

    def close(self) -> None:
        if self._finished or self.closed:
            return
        self._finished = True  # also stops IOBase.__del__ from retrying a failed write
        try:
            self._commit()
        except BaseException:
            try:
                super().close()
            except BufferError:
                pass  # the failed write's traceback still holds a view; freed along with it
            raise
        super().close()

    def _commit(self) -> None:
        view = self.getbuffer()
        data = torch.frombuffer(view, dtype=torch.uint8) if len(view) else torch.empty(0, dtype=torch.uint8)
        tmp = durable.temp_name(self._path)
        try:
            open(tmp, "xb").close()  # exists even when empty
            self._fs.handle().write_many(tmp, [(data, 0)], fsync=True).result()
            durable.commit(tmp, self._path, fsync_file=False)
        except BaseException:
            durable.remove_quietly(tmp)
            raise
        finally:
            del data, view


class _MemoryReadStream(io.RawIOBase):
    """A seekable, read-only stream over byte ranges already read into memory.

    ``ranges`` maps a file offset to a (future, uint8 tensor) holding the bytes from there.
    """

    def __init__(self, path: str, ranges: dict[int, tuple[Future[int] | None, torch.Tensor]],
                 size: int) -> None:
        super().__init__()
        self.path = path
        self.size = size
        self._ranges = ranges
        self._views: dict[int, memoryview] = {}
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            self._pos = offset
        elif whence == io.SEEK_CUR:
            self._pos += offset
        else:
            self._pos = self.size + offset
        return self._pos

    def _locate(self) -> tuple[memoryview, int]:
        for start, (fut, buf) in self._ranges.items():
            if start <= self._pos < start + buf.numel():
                if fut is not None:
                    fut.result()
                return self._views.setdefault(start, byte_view(buf)), self._pos - start
        return memoryview(b""), 0

    def slice(self, offset: int, length: int) -> _MemoryReadStream:
        """A stream over bytes ``[offset, offset + length)`` of the file, sharing the memory."""
        self._pos = offset
        view, at = self._locate()
        if len(view) - at < length:
            raise OSError(f"{self.path!r}: bytes {offset}..{offset + length} were not read")
        buf = torch.frombuffer(view, dtype=torch.uint8)[at:at + length] if length else torch.empty(0, dtype=torch.uint8)
        return _MemoryReadStream(self.path, {0: (None, buf)}, length)

    def read(self, size: int = -1) -> bytes:
        view, at = self._locate()
        end = len(view) if size is None or size < 0 else min(len(view), at + size)
        data = bytes(view[at:end])
        self._pos += len(data)
        return data

    def readinto(self, b: Any) -> int:
        view, at = self._locate()
        n = min(len(b), len(view) - at)
        if n <= 0:
            return 0
        memoryview(b).cast("B")[:n] = view[at:at + n]
        self._pos += n
        return n


class _EngineFileSystem(FileSystem):
    """DCP's local FileSystem with data files written and read by the deepnvme engine."""

    def __init__(self, config: IOConfig) -> None:
        self.config = config
        self._handle: AioHandle | None = None
        self._lock = threading.Lock()  # DCP's writer threads share this file system
        self.replacing = False  # set during finish(): rm_file before a rename onto it is skipped
        self.wanted: dict[str, list[tuple[int, int]]] = {}

    def handle(self) -> AioHandle:
        """The shared handle, made on first use (again after :meth:`close`)."""
        with self._lock:
            if self._handle is None:
                self._handle = AioHandle(config=self.config)
            return self._handle

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        path = os.fspath(path)
        if "w" in mode:
            stream: io.IOBase = _DurableWriteStream(self, path)
        elif mode in ("rb", "r+b"):
            stream = self._prefetch(path)
        else:
            with super().create_stream(path, mode) as plain:
                yield plain
            return
        try:
            yield stream
        except BaseException:
            if isinstance(stream, _DurableWriteStream):
                stream.abort()  # a failed serialization must not leave a partial file
            raise
        stream.close()

    def _prefetch(self, path: str) -> _MemoryReadStream:
        ranges = sorted(set(self.wanted.get(path) or [(0, os.stat(path).st_size)]))
        buffers: dict[int, tuple[Future[int] | None, torch.Tensor]] = {}
        for offset, length in ranges:
            buf = aligned_empty(length, offset)
            fut = self.handle().submit_read(buf, path, offset=offset) if length else None
            buffers[offset] = (fut, buf)
        return _MemoryReadStream(path, buffers, os.stat(path).st_size)

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        if self.replacing:
            return  # the rename that follows replaces the file atomically; removing it first
            # would leave no file at all if that rename failed (or the process died in between)
        super().rm_file(path)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        """Durably and atomically replace ``new_path`` with ``path``; on failure ``path`` is removed."""
        try:
            durable.commit(os.fspath(path), os.fspath(new_path), fsync_file=True)
        except BaseException:
            durable.remove_quietly(os.fspath(path))
            raise

    def close(self) -> None:
        """Stop the handle's worker threads (after its outstanding I/O); reusable afterwards."""
        with self._lock:
            handle, self._handle = self._handle, None
        if handle is not None:
            handle.close()


class NVMeStorageWriter(FileSystemWriter):
    """``FileSystemWriter`` whose files are written by the deepnvme engine.

    Each file is fsynced, then atomically renamed into place; ``.metadata`` comes last and
    replaces the previous one in one rename, so a failed save into a new directory leaves no
    ``.metadata``. Saving over an existing checkpoint is all-or-nothing too: every save names
    its data files with a fresh token (``__<rank>_<token>_<n>.distcp``), so the previous
    save's files stay untouched until the new ``.metadata`` replaces the old one; then the
    coordinator removes the ``__*.distcp`` files the new ``.metadata`` does not name (the
    previous save's, and those of a save that failed). A directory holds one checkpoint.

    ``config`` tunes the I/O (see :mod:`deepnvme.config`); other keyword arguments are
    ``FileSystemWriter``'s. ``sync_files`` is always on: every file is fsynced before rename.
    """

    fs: _EngineFileSystem

    def __init__(self, path: str | os.PathLike[str], *,
                 config: IOConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        kwargs["sync_files"] = False  # our streams fsync themselves; never os.sync()
        super().__init__(path, **kwargs)
        self.fs = _EngineFileSystem(checkpoint_config(config))
        self.path = self.fs.init_path(path)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Name this save's files apart from the previous save's (one token for all ranks)."""
        token = secrets.token_hex(4)
        return [dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_{token}_"))
                if plan.storage_data is None else plan for i, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        fut = super().write_data(plan, planner)
        fut.add_done_callback(lambda _: self.fs.close())  # every rank; runs now if already done
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.fs.replacing = True  # keep the old .metadata until the new one replaces it
        try:
            super().finish(metadata, results)
        finally:
            self.fs.replacing = False
            self.fs.close()
        if self.use_collectives:  # this .metadata names every rank's files
            self._remove_unnamed_data_files(metadata)

    def _remove_unnamed_data_files(self, metadata: Metadata) -> None:
        """Delete the data files the committed ``.metadata`` does not name (older saves')."""
        named = {os.path.basename(os.fspath(info.relative_path))
                 for info in metadata.storage_data.values()}
        directory = os.fspath(self.path)
        for name in os.listdir(directory):
            if name.startswith("__") and name.endswith(DEFAULT_SUFFIX) and name not in named:
                durable.remove_quietly(os.path.join(directory, name))


class NVMeStorageReader(FileSystemReader):
    """``FileSystemReader`` that reads each needed byte range in parallel with the engine."""

    fs: _EngineFileSystem

    def __init__(self, path: str | os.PathLike[str], *,
                 config: IOConfig | Mapping[str, Any] | None = None) -> None:
        super().__init__(path)
        self.fs = _EngineFileSystem(checkpoint_config(config))
        self.path = self.fs.init_path(path)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        wanted: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            info = self.storage_data[item.storage_index]
            full = os.fspath(self.fs.concat_path(self.path, info.relative_path))
            wanted.setdefault(full, []).append((info.offset, info.length))
        self.fs.wanted = wanted
        try:
            return super().read_data(plan, planner)
        finally:
            self.fs.wanted = {}
            self.fs.close()  # the base class has read everything by now

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        return file.slice(sinfo.offset, sinfo.length)
