"""``deepnvme.save``: torch.save-compatible files written at the storage's speed.

PyTorch writes the zip skeleton (``torch.serialization.skip_data()`` with every storage record
aligned to 4096 bytes), so the format is PyTorch's own; deepnvme then writes each storage's
bytes into its record with the parallel O_DIRECT engine, straight from tensor memory, and
commits the file atomically (temporary name, fsync, rename, fsync directory).

The storage records carry a zero CRC, exactly as ``torch.save`` under ``skip_data`` or with
``compute_crc32=False`` writes them; ``torch.load`` does not check record CRCs.
"""

from __future__ import annotations

import logging
import os
import pickle
import types
from collections.abc import Mapping
from typing import IO, Any

import torch

from ..config import IOConfig, checkpoint_config
from ..formats.torchzip import (
    STORAGE_ALIGNMENT,
    RecordSpan,
    batch_small_records,
    check_sizes,
    read_record_spans,
    storage_spans,
)
from ..handles.aio import AioHandle
from ..io import durable
from ..io.file import read_buffered, reserve
from ..io.volume import VolumePath
from ..io.volume_files import remove, rename, temp_path
from ..memory.views import aligned_empty, storage_bytes
from ._paths import as_path

__all__ = ["save", "write_skeleton", "pickle_skeleton", "StorageLayout", "gather_small", "write_storages",
           "save_striped", "file_items"]

log = logging.getLogger(__name__)


class _CapturingPickleModule(types.SimpleNamespace):
    """A ``pickle_module`` for torch.save that records which storage each record key names.

    torch.save subclasses ``pickle_module.Pickler`` and overrides ``persistent_id``; the
    subclass hook wraps that method so every ``("storage", type, key, location, numel)`` id
    it returns is seen together with the storage object it was made from.
    """

    def __init__(self) -> None:
        storages: dict[str, torch.UntypedStorage] = {}

        class Pickler(pickle.Pickler):
            def __init_subclass__(cls, **kwargs: Any) -> None:
                super().__init_subclass__(**kwargs)
                original = cls.persistent_id

                def persistent_id(self: Any, obj: Any) -> Any:
                    pid = original(self, obj)
                    if isinstance(pid, tuple) and pid and pid[0] == "storage":
                        st = obj._untyped_storage if isinstance(obj, torch.storage.TypedStorage) else obj
                        storages.setdefault(pid[2], st)
                    return pid

                cls.persistent_id = persistent_id  # type: ignore[method-assign]

        super().__init__(**{k: getattr(pickle, k) for k in dir(pickle) if not k.startswith("__")})
        self.__name__ = "deepnvme_capturing_pickle"
        self.Pickler = Pickler
        self.storages = storages


class StorageLayout:
    """Where each storage of a saved object goes: ``items[key] = (storage, RecordSpan)``."""

    def __init__(self, items: dict[str, tuple[torch.UntypedStorage, RecordSpan]]) -> None:
        self.items = items

    @property
    def nbytes(self) -> int:
        return sum(span.size for _, span in self.items.values())


def pickle_skeleton(obj: Any, path: str) -> dict[str, torch.UntypedStorage]:
    """torch.save ``obj`` to ``path`` without storage bytes; return each record key's storage.

    Records are aligned to :data:`STORAGE_ALIGNMENT`. ``path`` may be ``os.devnull`` to learn
    the keys only. Blocks.
    """
    from torch.utils.serialization import config as ser_config

    capture = _CapturingPickleModule()
    # Opened without O_TRUNC: a recycled file keeps its blocks. PyTorch seeks over the storage
    # bytes of a file object (nothing is written there), and the file is cut to its new end.
    with open(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666), "r+b") as f:
        with ser_config.patch({"save.storage_alignment": STORAGE_ALIGNMENT}):  # type: ignore[attr-defined]
            with torch.serialization.skip_data():
                torch.save(obj, f, pickle_module=capture)
        if os.path.isfile(path):
            f.truncate(f.tell())
    return capture.storages


def write_skeleton(obj: Any, path: str) -> StorageLayout:
    """Let torch.save write ``path`` without storage bytes; return where each storage belongs.

    Blocks. The records are aligned to :data:`STORAGE_ALIGNMENT`; the holes are filled later.
    """
    storages = pickle_skeleton(obj, path)
    with open(path, "rb") as f:
        spans = storage_spans(read_record_spans(f, path=path, file_size=os.fstat(f.fileno()).st_size))
    check_sizes(spans, {k: s.nbytes() for k, s in storages.items()}, path=path)
    return StorageLayout({k: (storages[k], spans[k]) for k in spans})


def gather_small(path: str, layout: StorageLayout, keys: list[str] | None = None
                 ) -> tuple[list[str], list[tuple[torch.Tensor, int, list[str]]]]:
    """Split the storages ``keys`` (default: all) into those written straight from tensor memory
    and runs of small ones copied now, with the zip headers between them (read back from the
    skeleton), into one region each: ``(large keys, [(region, file offset, its keys)])``."""
    chosen = layout.items if keys is None else {k: layout.items[k] for k in keys}
    spans = {k: span for k, (_, span) in chosen.items()}
    large: list[str] = []
    regions: list[tuple[torch.Tensor, int, list[str]]] = []
    for group in batch_small_records(spans):
        if len(group) == 1:
            large.append(group[0])
            continue
        start, end = spans[group[0]].offset, spans[group[-1]].end
        region = aligned_empty(end - start, start)
        read_buffered(path, region, start)
        for key in group:
            storage, span = chosen[key]
            if span.size:
                region[span.offset - start:span.end - start].copy_(storage_bytes(storage))
        regions.append((region, start, group))
    return large, regions


def write_storages(handle: AioHandle, path: str, layout: StorageLayout, keys: list[str] | None = None,
                   *, fsync: bool = True) -> None:
    """Write the bytes of the storages ``keys`` (default: all) into their records. Blocks.

    Large storages are written straight from tensor memory; runs of small ones are gathered
    into one request each (:func:`gather_small`).
    """
    large, regions = gather_small(path, layout, keys)
    items = [(storage_bytes(layout.items[k][0]), layout.items[k][1].offset) for k in large]
    items += [(region, start) for region, start, _ in regions]
    handle.write_many(path, items, fsync=fsync).result()


def save(obj: Any, path: str | os.PathLike[str] | IO[bytes] | VolumePath, *,
         config: IOConfig | Mapping[str, Any] | None = None, recycle: bool = False,
         ) -> None:
    """Save ``obj`` to ``path`` like ``torch.save``; blocks until the file is durable.

    The result loads with plain ``torch.load(path, weights_only=True)`` (and ``mmap=True``).
    The previous file at ``path`` stays intact until the new one is complete and fsynced;
    on any error the temporary file is removed and the error (an ``OSError`` for I/O
    failures, naming file/offset/size) is raised. Tensors must not be modified until it
    returns (use :func:`deepnvme.async_save` to overlap with training). ``recycle=True``
    keeps the replaced file as a spare that the next save to ``path`` overwrites (faster
    than a new file; costs a second copy on disk; see :mod:`deepnvme.io.durable`).
    Do not recycle while anything still reads or maps an older version of ``path``
    (``torch.load(mmap=True)`` results): the save after next overwrites its blocks in place.

    When ``path`` is a symlink, the file it points to is replaced and the link stays (as with
    ``torch.save``). A writable binary file object (``io.BytesIO``, ``open(..., "wb")``) is
    handed to ``torch.save`` itself: no parallel I/O and no atomic replace for those.
    A :class:`~deepnvme.Volume` path saves one file striped over the volume's drives (read it
    with :func:`deepnvme.load`, or ``deepnvme volume join`` it into a plain file).
    """
    if isinstance(path, VolumePath):
        save_striped(obj, path, checkpoint_config(config))
        return
    if not isinstance(path, (str, os.PathLike)) and hasattr(path, "write"):
        log.debug("deepnvme.save: %r is a file object, not a path: written by torch.save "
                  "(no parallel O_DIRECT I/O, no atomic replace)", path)
        torch.save(obj, path)
        return
    path = as_path(path, "deepnvme.save",
                   "a str or os.PathLike file path, or a writable binary file object")
    cfg = checkpoint_config(config)
    with durable.atomic_target(path, recycle=recycle) as tmp:
        layout = write_skeleton(obj, tmp)
        reserve(tmp, os.path.getsize(tmp))
        with AioHandle(config=cfg) as handle:
            write_storages(handle, tmp, layout)


def save_striped(obj: object, vpath: VolumePath, cfg: IOConfig) -> None:
    """Save ``obj`` as a striped torch.save file at ``vpath``; blocks until it is durable."""
    first = os.path.join(vpath.volume.paths[0], os.path.dirname(vpath.name))
    os.makedirs(first, exist_ok=True)
    skeleton = durable.create_temp(first, os.path.basename(vpath.name) + ".skeleton")
    tmp = temp_path(vpath)
    try:
        layout = write_skeleton(obj, skeleton)
        items = file_items(skeleton, layout)
        with AioHandle(config=cfg) as handle:
            handle.write_many(tmp, items, fsync=True).result()
        rename(tmp, vpath)
    except BaseException:
        remove(tmp)
        raise
    finally:
        durable.remove_quietly(skeleton)


def file_items(skeleton: str, layout: StorageLayout) -> list[tuple[torch.Tensor, int]]:
    """Every byte of the file as (buffer, offset) items: the skeleton's header regions between
    the storage records (read now) and each storage's own memory."""
    size = os.path.getsize(skeleton)
    spans = sorted(((span, storage) for storage, span in layout.items.values()),
                   key=lambda item: item[0].offset)
    items: list[tuple[torch.Tensor, int]] = []
    pos = 0
    for span, storage in spans + [(RecordSpan(name="", offset=size, size=0), None)]:
        if span.offset > pos:
            region = aligned_empty(span.offset - pos, pos)
            read_buffered(skeleton, region, pos)
            items.append((region, pos))
        if storage is not None and span.size:
            items.append((storage_bytes(storage), span.offset))
        pos = max(pos, span.offset + span.size)
    return items
