"""A model folder's safetensors weights as a stream of ``(name, tensor)``, read in bounded windows.

Framework-free (a serving engine's loader consumes the iterator): tensors are grouped, in file
order, into contiguous byte ranges of at most ``read_window`` bytes (a larger tensor is a range
of its own); each range is one engine read into an O_DIRECT-aligned buffer and yielded as
views of it. The next range is read while the consumer copies the current one, so the stream
holds at most ``2 x max(read_window, largest tensor)`` bytes of buffers (plus the engine's bounce
space, see :mod:`deepnvme.config`); tensors the consumer keeps alive keep their range alive.
Buffers are reused (:class:`_Windows`): new memory costs page faults that, on a fast device,
take longer than the read. Yielded tensors are never overwritten: a buffer is reused only once
no tensor views it any more (its storage's use count), else a new one is made.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection, Generator, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from ..config import SETTINGS, IOConfig, checkpoint_config, parse_size
from ..errors import CheckpointFormatError, ConfigError, DeepNVMeError
from ..formats.index import tensor_index
from ..formats.safetensors import StoredTensor
from ..handles.aio import AioHandle

__all__ = ["DEFAULT_READ_WINDOW", "LOADER_KEYS", "LoaderOptions", "ReadRange", "loader_options",
           "plan_ranges", "checkpoint_tensors", "size_setting", "stream_tensors", "stream_weights"]

DEFAULT_READ_WINDOW = 64 << 20
"""Bytes per read range unless ``read_window`` says otherwise."""

LOADER_KEYS: Mapping[str, str] = {
    "read_window": "bytes read per range (int or size string such as '64M'); the stream holds "
                   "at most two ranges (or two of the largest tensor, if larger)",
}
"""Extra-config keys of the loader itself; every other key must be a deepnvme I/O setting."""


@dataclasses.dataclass(frozen=True)
class LoaderOptions:
    """Validated loader settings: the engine's ``io`` config and the ``read_window`` in bytes."""

    io: IOConfig
    read_window: int = DEFAULT_READ_WINDOW


def size_setting(source: str, key: str, value: Any, *, minimum: int) -> int:
    """``value`` of ``source[key]`` in bytes (int or size string), at least ``minimum``; else a
    :class:`ConfigError` naming the key."""
    try:
        size = parse_size(value)
    except ConfigError as exc:
        raise ConfigError(f"{source}[{key!r}]: {exc}") from None
    if size < minimum:
        raise ConfigError(f"{source}[{key!r}] must be at least {minimum} bytes, got {value!r}")
    return size


def loader_options(extra: Mapping[str, Any] | None, *, source: str = "model_loader_extra_config",
                   load_format: str = "deepnvme", also_known: Collection[str] = ()) -> LoaderOptions:
    """Check ``extra`` (e.g. vLLM's ``model_loader_extra_config``) and resolve it.

    Keys are :data:`LOADER_KEYS` and the I/O settings of :data:`deepnvme.config.SETTINGS`;
    unset I/O settings take the checkpoint profile (several threads: weights are large reads).
    Any unknown key or bad value raises :class:`ConfigError` naming ``source`` and the key
    (``load_format`` and the caller's own keys ``also_known``, already removed, name the rest).
    """
    if extra is None:
        extra = {}
    if not isinstance(extra, Mapping):
        raise ConfigError(f"{source} must be a JSON object (a dict), got {type(extra).__name__}")
    io_keys = {s.name for s in SETTINGS}
    known = sorted(io_keys | set(LOADER_KEYS) | set(also_known))
    io: dict[str, Any] = {}
    window = DEFAULT_READ_WINDOW
    for key, value in extra.items():
        if key == "read_window":
            window = size_setting(source, key, value, minimum=1)
        elif key in io_keys:
            io[key] = value
        else:
            raise ConfigError(f"{source}: unknown key {key!r} for load_format {load_format!r}; "
                              f"known keys: {', '.join(known)}")
    for key, value in io.items():
        try:
            checkpoint_config({key: value})
        except ConfigError as exc:
            raise ConfigError(f"{source}[{key!r}]: {exc}") from None
    return LoaderOptions(io=checkpoint_config(io), read_window=window)


@dataclasses.dataclass(frozen=True)
class ReadRange:
    """One read: ``nbytes`` at absolute ``offset`` of ``file``, holding ``tensors`` back to back."""

    file: str
    offset: int
    nbytes: int
    tensors: tuple[StoredTensor, ...]


def plan_ranges(tensors: Sequence[StoredTensor], window: int) -> list[ReadRange]:
    """Group ``tensors`` (sorted by file, then offset) into contiguous ranges of at most ``window``
    bytes; a tensor larger than ``window`` gets a range of its own. Pure."""
    if window < 1:
        raise ValueError(f"window must be >= 1 byte, got {window}")
    out: list[ReadRange] = []
    group: list[StoredTensor] = []
    start = end = 0
    for t in tensors:
        joins = (group and t.file == group[0].file and t.offset == end
                 and t.offset + t.nbytes - start <= window)
        if group and not joins:
            out.append(ReadRange(group[0].file, start, end - start, tuple(group)))
            group = []
        if not group:
            start = end = t.offset
        group.append(t)
        end = t.offset + t.nbytes
    if group:
        out.append(ReadRange(group[0].file, start, end - start, tuple(group)))
    return out


def checkpoint_tensors(model_dir: str, *, load_format: str = "deepnvme") -> list[StoredTensor]:
    """Every tensor of the safetensors checkpoint in the local folder ``model_dir``, sorted by
    file and offset: ``model.safetensors``, or the shards ``model.safetensors.index.json`` names
    (other files are ignored), or without either every ``*.safetensors`` file, as vLLM's default
    loader takes them. Reads headers only. ``load_format`` names the caller in the error
    for a ``model_dir`` that is not a local folder."""
    if not os.path.isdir(model_dir):
        raise DeepNVMeError(f"load_format {load_format!r} reads a local model folder, and {model_dir!r} is "
                            "not one: download the model first (e.g. `hf download REPO --local-dir "
                            "DIR`) and pass DIR as the model")
    return tensor_index(model_dir, kinds=("safetensors",), any_safetensors=True).in_file_order()


def _view(buffer: torch.Tensor, start: int, t: StoredTensor) -> torch.Tensor:
    if t.nbytes == 0:
        return torch.empty(t.shape, dtype=t.dtype)
    raw = buffer[start:start + t.nbytes]
    if start % t.dtype.itemsize:   # not element-aligned in the range: view() refuses, so copy
        raw = raw.clone()
    return raw.view(t.dtype).reshape(t.shape)


_use_count = getattr(torch._C, "_storage_Use_Count", None)   # private: without it, no reuse


class _Windows:
    """Up to two reused read buffers (raw storages of at least ``window`` bytes plus alignment).

    A storage is handed out again only when its use count is 1 (this pool's own reference): no
    yielded tensor, no read in flight and no view the consumer kept still points into it."""

    def __init__(self, window: int, alignment: int) -> None:
        self.window, self.alignment = window, alignment
        self._raws: list[torch.UntypedStorage] = []
        self.made = 0  # buffers allocated (for tests)

    def take(self, nbytes: int, file_offset: int) -> torch.Tensor:
        """An uninitialised uint8 tensor of ``nbytes`` whose address is congruent to
        ``file_offset`` modulo the alignment."""
        need = nbytes + self.alignment
        raw = next((r for r in self._raws if r.nbytes() >= need and _use_count is not None
                    and _use_count(r._cdata) == 1), None)
        if raw is None:
            raw = torch.empty(max(need, self.window + self.alignment), dtype=torch.uint8).untyped_storage()
            self.made += 1
            self._raws.append(raw)
            if len(self._raws) > 2:   # keep the two largest; the others go when unused
                self._raws.sort(key=lambda r: r.nbytes(), reverse=True)
                del self._raws[2:]
        pad = (file_offset - raw.data_ptr()) % self.alignment
        return torch.empty(0, dtype=torch.uint8).set_(raw, pad, (nbytes,), (1,))


def stream_weights(model_dir: str, options: LoaderOptions
                   ) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Yield ``(name, tensor)`` for every tensor of the checkpoint in ``model_dir``: see
    :func:`stream_tensors`."""
    yield from stream_tensors(checkpoint_tensors(model_dir), options)


def stream_tensors(tensors: Sequence[StoredTensor], options: LoaderOptions
                   ) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Yield ``(name, tensor)`` for ``tensors`` (sorted by file and offset, as
    :func:`checkpoint_tensors` returns them; CPU tensors, the file's dtype), reading the next
    range while the caller consumes the current one.
    Blocks while a range is read; a failed or short read raises. ``close()`` (or exhausting it)
    waits for the read in flight and stops the engine's threads. Not thread-safe."""
    ranges = plan_ranges(tensors, options.read_window)
    windows = _Windows(options.read_window, options.io.alignment)
    with AioHandle(config=options.io) as handle:
        def start(r: ReadRange) -> tuple[ReadRange, torch.Tensor, Future[int] | None]:
            buf = windows.take(r.nbytes, r.offset)
            return r, buf, handle.submit_read(buf, r.file, offset=r.offset) if r.nbytes else None

        pending = start(ranges[0]) if ranges else None
        for i in range(len(ranges)):
            if pending is None:
                break
            r, buf, fut = pending
            if fut is not None and fut.result() != r.nbytes:
                raise CheckpointFormatError(f"{r.file!r}: short read of {r.nbytes} bytes at offset {r.offset}")
            pending = start(ranges[i + 1]) if i + 1 < len(ranges) else None
            views = [(t.name, _view(buf, t.offset - r.offset, t)) for t in r.tensors]
            del buf
            views.reverse()
            while views:   # popped as yielded: the stream keeps no reference to a consumed tensor
                yield views.pop()
