"""Byte movement under the DCP plugin: coalesced read spans, torch.save item parsing, streamed writes.

Pure planning (:func:`coalesce`) and parsing (:func:`parse_saved_tensor`) have no I/O;
:class:`StreamingWriteStream` writes a file through a few reused aligned buffers.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import io
import pickle
import struct
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, Protocol

import torch

from ...handles.aio import AioHandle
from ...io import durable
from ...io.plan import Span, coalesce
from ...memory.copy import copy_bytes
from ...memory.views import aligned_empty, byte_view

__all__ = ["Span", "coalesce", "SavedTensor", "TensorLayout", "parse_layout", "parse_saved_tensor",
           "slice_extent", "contiguous_run", "copy_saved", "RunningHash", "StreamingWriteStream"]


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """A tensor saved by ``torch.save``: its storage record's bytes and its view of them."""

    data: torch.Tensor  # uint8, the storage record's bytes (aliases the caller's buffer)
    dtype: torch.dtype
    storage_offset: int  # elements
    size: tuple[int, ...]
    stride: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class TensorLayout:
    """Where a ``torch.save(tensor)`` item keeps its storage record, and how the tensor views it."""

    record: int  # byte offset of the storage record in the item
    record_length: int  # bytes
    dtype: torch.dtype
    storage_offset: int  # elements
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Unsupported(Exception):
    """The item uses something this parser does not handle; the caller falls back to torch.load."""


_PARALLEL_COPY = 32 << 20  # bytes from which a copy is shared among threads (memory.copy)
_CD = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry
_EOCD = struct.Struct("<IHHHHIIH")
_LOCAL = struct.Struct("<IHHHHHIIIHH")


def _window(head: memoryview, tail: memoryview, tail_start: int, start: int, end: int) -> memoryview:
    """Item bytes ``[start, end)`` from the head window (item bytes from 0) or the tail window
    (item bytes from ``tail_start``); _Unsupported if the range lies in neither."""
    if 0 <= start <= end <= len(head):
        return head[start:end]
    if tail_start <= start <= end <= tail_start + len(tail):
        return tail[start - tail_start:end - tail_start]
    raise _Unsupported(f"bytes {start}..{end} lie outside the probed windows")


def _records(head: memoryview, tail: memoryview, tail_start: int) -> dict[str, tuple[int, int]]:
    """Record name (without the archive folder) -> (data offset, size) from the zip's central
    directory. The item's bytes are known only in ``head`` (from its start) and ``tail`` (its
    last bytes, from ``tail_start``); for a whole item both are the whole item and 0."""
    total = tail_start + len(tail)
    if len(tail) < _EOCD.size:
        raise _Unsupported("too short for a zip")
    sig, _disk, _cd_disk, _n_disk, count, cd_size, cd_off, comment = _EOCD.unpack_from(tail, len(tail) - _EOCD.size)
    if sig != 0x06054B50 or comment or cd_off == 0xFFFFFFFF or count == 0xFFFF:
        raise _Unsupported("no plain end-of-central-directory record (zip64 or a comment)")
    directory = _window(head, tail, tail_start, cd_off, cd_off + cd_size)
    out: dict[str, tuple[int, int]] = {}
    pos = 0
    for _ in range(count):
        f = _CD.unpack_from(directory, pos)
        if f[0] != 0x02014B50 or f[4] != 0:
            raise _Unsupported("bad or compressed central directory entry")
        csize, name_len, extra_len, comment_len, local = f[8], f[10], f[11], f[12], f[16]
        name = bytes(directory[pos + _CD.size:pos + _CD.size + name_len]).decode()
        lf = _LOCAL.unpack_from(_window(head, tail, tail_start, local, local + _LOCAL.size))
        if lf[0] != 0x04034B50 or csize == 0xFFFFFFFF:
            raise _Unsupported("bad local header or zip64 sizes")
        data = local + _LOCAL.size + lf[9] + lf[10]
        if data + csize > total:
            raise _Unsupported("record past the end of the item")
        out[name.split("/", 1)[-1]] = (data, csize)
        pos += _CD.size + name_len + extra_len + comment_len
    return out


def _rebuild(storage: Any, storage_offset: int, size: tuple[int, ...], stride: tuple[int, ...],
             *rest: Any) -> tuple[Any, int, tuple[int, ...], tuple[int, ...]]:
    return storage, storage_offset, tuple(size), tuple(stride)


@functools.cache
def _storage_dtypes() -> dict[str, torch.dtype]:
    """Legacy storage class name (as torch.save pickles it) -> dtype; empty if torch lacks the table."""
    table = getattr(torch.storage, "_dtype_to_storage_type_map", None)
    return {name: dtype for dtype, name in table().items()} if callable(table) else {}


class _TensorUnpickler(pickle.Unpickler):
    """Reads a pickled plain tensor's layout; any other global is refused (no code runs)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _storage_dtypes():
            return _storage_dtypes()[name]
        raise _Unsupported(f"global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], torch.dtype)):
            raise _Unsupported("unexpected persistent id")
        return pid[1], str(pid[2])


def _item_bytes(item: torch.Tensor) -> memoryview:
    """``item``'s bytes without a copy: through NumPy where it is installed (byte_view builds a
    ctypes type per call, too slow per item), else through byte_view (the base install)."""
    try:
        return item.numpy().data
    except RuntimeError:  # "Numpy is not available"
        return byte_view(item)


def parse_layout(head: memoryview, tail: memoryview, tail_start: int) -> TensorLayout | None:
    """The layout of a ``torch.save(tensor)`` item known by its first bytes ``head`` and its last
    bytes ``tail`` (which start at item byte ``tail_start``), or None if it is anything else or
    a needed byte lies outside both windows (the caller then reads the whole item)."""
    try:
        records = _records(head, tail, tail_start)
        order = records.get("byteorder")
        if order is not None and bytes(_window(head, tail, tail_start, order[0], order[0] + order[1])) != b"little":
            raise _Unsupported("big-endian")
        pkl = records["data.pkl"]
        pickled = _window(head, tail, tail_start, pkl[0], pkl[0] + pkl[1])
        result = _TensorUnpickler(io.BytesIO(pickled)).load()
        if not (isinstance(result, tuple) and len(result) == 4 and isinstance(result[0], tuple)):
            raise _Unsupported("not a single tensor")
        (dtype, key), storage_offset, size, stride = result
        start, length = records[f"data/{key}"]
    except (_Unsupported, KeyError, ValueError, struct.error, pickle.UnpicklingError,
            UnicodeDecodeError, EOFError):
        return None
    return TensorLayout(start, length, dtype, int(storage_offset), size, stride)


def parse_saved_tensor(item: torch.Tensor) -> SavedTensor | None:
    """The tensor of a ``torch.save(tensor)`` item held in ``item`` (uint8), or None if it is
    anything else (the caller then uses ``torch.load``). Nothing is copied."""
    view = _item_bytes(item)
    layout = parse_layout(view, view, 0)
    if layout is None:
        return None
    return SavedTensor(item[layout.record:layout.record + layout.record_length], layout.dtype,
                       layout.storage_offset, layout.size, layout.stride)


def slice_extent(layout: TensorLayout, offsets: Sequence[int], lengths: Sequence[int]
                 ) -> tuple[int, int]:
    """Bytes ``(start, length)`` of the storage record that hold the tensor narrowed to
    ``offsets``/``lengths`` (from its first to its last element); ``(0, 0)`` if it is empty.
    ValueError if the narrowed tensor reaches past the record (a malformed item)."""
    if len(offsets) != len(layout.size) or len(lengths) != len(layout.size):
        raise ValueError(f"a {len(offsets)}-d read of a {len(layout.size)}-d tensor")
    if any(o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, lengths, layout.size)):
        raise ValueError(f"a read of {tuple(lengths)} at {tuple(offsets)} from a tensor of "
                         f"size {tuple(layout.size)}")
    if any(n == 0 for n in lengths):
        return 0, 0
    first = layout.storage_offset + sum(o * s for o, s in zip(offsets, layout.stride))
    last = first + sum((n - 1) * s for n, s in zip(lengths, layout.stride))
    esize = layout.dtype.itemsize
    if first < 0 or (last + 1) * esize > layout.record_length:
        raise ValueError(f"elements {first}..{last} of a {layout.record_length}-byte storage record")
    return first * esize, (last - first + 1) * esize


def contiguous_run(saved: SavedTensor | TensorLayout, offsets: Sequence[int], lengths: Sequence[int]
                   ) -> tuple[int, int] | None:
    """Byte (start, length) of the narrowed region if it is one contiguous run of a C-contiguous tensor."""
    expect = 1
    for n, s in zip(reversed(saved.size), reversed(saved.stride)):
        if n != 1 and s != expect:
            return None
        expect *= n
    dims = len(saved.size)
    first = next((d for d in range(dims) if lengths[d] != 1), dims)
    if any(offsets[d] != 0 or lengths[d] != saved.size[d] for d in range(first + 1, dims)):
        return None
    esize = saved.dtype.itemsize
    start = saved.storage_offset + sum(o * s for o, s in zip(offsets, saved.stride))
    count = 1
    for n in lengths:
        count *= n
    return start * esize, count * esize


def copy_saved(saved: SavedTensor, offsets: Sequence[int], lengths: Sequence[int],
               target: torch.Tensor) -> None:
    """Copy ``saved`` narrowed to ``offsets``/``lengths`` into ``target`` (same shape and dtype
    checked); a contiguous run is copied as bytes, anything else through a strided view."""
    if tuple(target.size()) != tuple(lengths):
        raise ValueError(f"target size {tuple(target.size())} does not match the read's {tuple(lengths)}")
    run = contiguous_run(saved, offsets, lengths) if target.dtype == saved.dtype else None
    if run is not None and target.is_contiguous():
        start, nbytes = run
        if start + nbytes > saved.data.numel():
            raise ValueError("the saved storage is shorter than its tensor")
        if nbytes >= _PARALLEL_COPY:
            copy_bytes([(target.reshape(-1).view(torch.uint8), saved.data[start:start + nbytes])])
        elif nbytes:  # memmove: Tensor.copy_ of many uint8 elements wakes torch's thread pool
            ctypes.memmove(target.data_ptr(), saved.data.data_ptr() + start, nbytes)
        return
    data = saved.data
    if data.data_ptr() % saved.dtype.itemsize:
        data = data.clone()  # a typed view needs element alignment
    typed = data.view(saved.dtype)  # as_strided's offset counts from the storage's start, not the view's
    src = typed.as_strided(saved.size, saved.stride, typed.storage_offset() + saved.storage_offset)
    for dim, (off, n) in enumerate(zip(offsets, lengths)):
        src = src.narrow(dim, off, n)
    target.copy_(src)


def _take(pool: list[torch.Tensor], nbytes: int) -> torch.Tensor:
    """A buffer from ``pool`` (shared by writer threads; list.pop is atomic), else a new one."""
    try:
        return pool.pop()
    except IndexError:
        return aligned_empty(nbytes)


class RunningHash(Protocol):
    """A checksum fed the bytes of a file in order as they are written."""

    def update(self, data: Any) -> None: ...

    def value(self) -> int: ...


class StreamingWriteStream(io.RawIOBase):
    """Writes one file to a temporary name through ``buffers`` reused aligned buffers of ``chunk``
    bytes, each written by the engine while the next fills; ``close()`` fsyncs and renames.

    Memory bound: ``buffers x chunk`` bytes, taken from and returned to ``pool``. Not thread-safe
    (one DCP writer thread per stream).
    """

    def __init__(self, handle: Callable[[], AioHandle], path: str, pool: list[torch.Tensor], *,
                 chunk: int, buffers: int, running: RunningHash | None = None,
                 item_hashing: Callable[[], RunningHash] | None = None) -> None:
        super().__init__()
        self.running = running  # fed each buffer before it is written: the file's checksum
        # with item_hashing: the checksum of each run of bytes between two tell() calls (DCP's
        # writer calls tell() before and after each item), by (offset, length)
        self.item_sums: dict[tuple[int, int], int] = {}
        self._item_hashing = item_hashing
        self._seg = None if item_hashing is None else item_hashing()
        self._seg_start = 0
        self._handle = handle
        self._path = path
        self._tmp = durable.temp_name(path)
        open(self._tmp, "xb").close()  # exists even when nothing is written
        self._pool = pool
        self._bufs = [_take(pool, chunk) for _ in range(buffers)]
        self._views = [_item_bytes(b) for b in self._bufs]
        self._futs: list[Future[int] | None] = [None] * buffers
        self._chunk = chunk
        self._cur = self._fill = self._base = 0
        self._finished = False  # committed, failed or aborted: close() never writes again
        self.error: BaseException | None = None  # a failed write, kept: torch.save reports its own error instead

    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        pos = self._base + self._fill
        if self._seg is not None and pos > self._seg_start:
            self._cut(pos)
        return pos

    def _cut(self, pos: int) -> None:
        """End the hashed run of bytes at ``pos``; the next starts there."""
        if self._seg is None or self._item_hashing is None:
            return
        self.item_sums[(self._seg_start, pos - self._seg_start)] = self._seg.value()
        self._seg, self._seg_start = self._item_hashing(), pos

    def write(self, b: Any) -> int:
        mv = memoryview(b)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if self._seg is not None:
            self._seg.update(mv)
        n, fill = len(mv), self._fill
        if fill + n < self._chunk:  # the common case, kept short: torch.save writes many pieces
            self._views[self._cur][fill:fill + n] = mv
            self._fill = fill + n
            return n
        i = 0
        while i < n:
            take = min(self._chunk - self._fill, n - i)
            self._views[self._cur][self._fill:self._fill + take] = mv[i:i + take]
            self._fill += take
            i += take
            if self._fill == self._chunk:
                self._submit()
        return n

    def _submit(self) -> None:
        """Write the current buffer's bytes; then wait for the next buffer's previous write."""
        try:
            self._submit_buffer()
        except BaseException as exc:
            self.error = self.error or exc
            raise

    def _submit_buffer(self) -> None:
        if self._fill:
            if self.running is not None:
                self.running.update(self._views[self._cur][:self._fill])
            buf = self._bufs[self._cur][:self._fill]
            self._futs[self._cur] = self._handle().submit_write(buf, self._tmp, offset=self._base)
            self._base += self._fill
            self._fill = 0
            self._cur = (self._cur + 1) % len(self._bufs)
        fut, self._futs[self._cur] = self._futs[self._cur], None
        if fut is not None:
            fut.result()

    def _wait_all(self) -> BaseException | None:
        """Wait for every write in flight; the first failure, if any."""
        first: BaseException | None = None
        for i, fut in enumerate(self._futs):
            self._futs[i] = None
            if fut is not None and (exc := fut.exception()) is not None and first is None:
                first = exc
        return first

    def _release(self) -> None:
        self._pool.extend(self._bufs)
        self._bufs, self._views = [], []

    def abort(self) -> None:
        """Discard what was written: nothing reaches its final name (a no-op after close())."""
        if self._finished:
            return
        self._finished = True
        self._wait_all()  # its error, if any, does not matter: the file is discarded
        self._release()
        durable.remove_quietly(self._tmp)
        super().close()

    def close(self) -> None:
        if self._finished or self.closed:
            return
        self._finished = True  # also stops IOBase.__del__ from retrying a failed write
        try:
            try:
                self._submit()
            finally:
                failed = self._wait_all()
            if failed is not None:
                raise failed
            durable.commit(self._tmp, self._path, fsync_file=True)
        except BaseException:
            durable.remove_quietly(self._tmp)
            raise
        finally:
            self._release()
            super().close()
