"""``deepnvme.load``: read torch.save files with parallel O_DIRECT reads, rebuilt by torch itself.

The zip's central directory gives each storage record's offset and size; every record is read
in parallel into its own (4096-aligned) buffer while PyTorch's own loader, with its
``weights_only`` unpickler, rebuilds the object. PyTorch asks its zip reader for each storage;
a thin wrapper around that reader hands over the buffer read by deepnvme instead (waiting for
that record only), so unpickling overlaps the reads and no byte is copied twice.
"""

from __future__ import annotations

import logging
import os
import pickle
import sys
from collections.abc import Mapping
from concurrent.futures import Future
from typing import IO, Any, cast

import torch

from ..config import IOConfig, checkpoint_config
from ..errors import CheckpointFormatError, DeepNVMeIOError
from ..formats.hf_index import sniff_file
from ..formats.torchzip import (
    ZIP_MAGIC,
    RecordSpan,
    batch_small_records,
    read_record_spans,
    storage_spans,
)
from ..handles.aio import AioHandle, wait_all
from ..io.mapped import map_private
from ..io.mapped import populate as populate_mapping
from ..io.volume import Volume, VolumePath
from ..io.volume_files import striped_size
from ..memory.views import aligned_empty, storage_bytes
from ._folders import load_folder
from ._load_path import load_paths
from ._paths import as_path
from ._placed import is_placed, load_placed_folder
from ._striped import StripedReader

__all__ = ["load"]

log = logging.getLogger(__name__)


class _PrefetchedReader:
    """Wraps ``torch._C.PyTorchFileReader``; storage records come from deepnvme's buffers."""

    def __init__(self, reader: Any, buffers: dict[str, torch.Tensor],
                 futures: dict[str, Future[int]], path: str) -> None:
        self._reader = reader
        self._buffers = buffers
        self._futures = futures
        self._path = path

    def get_storage_from_record(self, name: str, numel: int, dtype: Any) -> torch.Tensor:
        key = name[5:] if name.startswith("data/") else None
        if key is None or key not in self._buffers:
            raise CheckpointFormatError(f"{self._path!r}: the pickle refers to storage record "
                                        f"{name!r}, which the archive does not have")
        buf = self._buffers[key]
        if buf.numel() != numel:
            raise CheckpointFormatError(f"{self._path!r}: record {name!r} holds {buf.numel()} "
                                        f"bytes but the pickle expects {numel}")
        fut = self._futures.get(key)
        if fut is not None:
            fut.result()
        return buf

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


def _prefetch(handle: AioHandle, path: str | VolumePath, spans: dict[str, RecordSpan]
              ) -> tuple[dict[str, torch.Tensor], dict[str, Future[int]]]:
    """Start reading every storage record; runs of small records share one request and buffer."""
    buffers: dict[str, torch.Tensor] = {}
    futures: dict[str, Future[int]] = {}
    for group in batch_small_records(spans):
        start, end = spans[group[0]].offset, spans[group[-1]].end
        region = aligned_empty(end - start, start)
        fut = handle.submit_read(region, path, offset=start) if end > start else None
        whole = region.untyped_storage()
        base = region.data_ptr() - whole.data_ptr()
        for key in group:
            span = spans[key]
            if len(group) == 1:
                buffers[key] = region
            else:
                lo = base + span.offset - start
                buffers[key] = storage_bytes(whole[lo:lo + span.size])
            if fut is not None:
                futures[key] = fut
    return buffers, futures


def load(path: str | os.PathLike[str] | IO[bytes] | Volume | VolumePath, map_location: Any = None, *,
         weights_only: bool = True, mmap: bool | None = None, populate: bool = True,
         config: IOConfig | Mapping[str, Any] | None = None) -> Any:
    """Load a ``torch.save`` file like ``torch.load(path, map_location, weights_only=...)``.

    Blocks until every tensor is in memory. With ``weights_only=True`` (the default) PyTorch's
    restricted unpickler is used, so a pickle that tries to run code is refused exactly as
    ``torch.load`` refuses it. A truncated or damaged file raises :class:`CheckpointFormatError`
    (a ``ValueError``) or an ``OSError`` naming the file; files that are not zip archives (the
    legacy pre-1.6 format) are handed to ``torch.load`` unchanged.

    Buffers: each large storage gets its own 4096-aligned allocation; runs of small storages
    share one (like ``mmap=True``, such storages cannot be resized). Not checked: record CRCs
    (``torch.load`` does not check them either), so flipped bytes inside tensor data go unseen.

    ``mmap=None`` (the default) reads by the path the file's device is fastest with (the
    ``load_path`` setting, measured per device on first use, see
    :mod:`deepnvme.checkpoint._load_path`): ``mmap=False`` (the parallel O_DIRECT reads above)
    or ``mmap=True``. ``mmap=True`` maps the file as ``torch.load(..., mmap=True)`` does (storages are
    copy-on-write views of the page cache, see :mod:`deepnvme.io.mapped`), then, unless
    ``populate=False``, reads every page in before returning with ``intra_op_parallelism``
    threads: the fastest fresh load on a fast device, since new memory is never zeroed.
    ``populate=False`` is ``torch.load(mmap=True)``'s lazy mapping (pages read on first use).
    A readable binary file object (``io.BytesIO``, ``open(..., "rb")``) is handed to ``torch.load``.

    A folder holding ``pytorch_model.bin``, or shards named by ``pytorch_model.bin.index.json``,
    gives one dict merging every file (loaded one after the other). A :class:`~deepnvme.Volume`
    path reads a file saved striped by :func:`deepnvme.save` (``mmap`` does not apply); a
    ``Volume`` or volume folder holding a placement record is a folder of whole files placed
    on the drives (``pytorch_model.bin`` shards), read on their drives at once.
    """
    if isinstance(path, Volume) or (isinstance(path, VolumePath) and is_placed(path)):
        return load_placed_folder(path, "torch", lambda file: load(
            file, map_location, weights_only=weights_only, mmap=mmap, populate=populate, config=config))
    if isinstance(path, VolumePath):
        return _load_striped(path, map_location, weights_only, checkpoint_config(config))
    if not isinstance(path, (str, os.PathLike)) and hasattr(path, "read"):
        log.debug("deepnvme.load: %r is a file object, not a path: read by torch.load", path)
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=mmap)
    path = as_path(path, "deepnvme.load",
                   "a str or os.PathLike file path, or a readable binary file object")
    if os.path.isdir(path):
        return load_folder(path, "torch", lambda file: load(
            file, map_location, weights_only=weights_only, mmap=mmap, populate=populate, config=config))
    if mmap and not populate:
        log.debug("deepnvme.load: mmap=True, populate=False for %s: mapped by torch.load", path)
        return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=True)
    cfg = checkpoint_config(config)
    if not _torch_internals_available():
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic != ZIP_MAGIC:
                if not magic:
                    raise CheckpointFormatError(f"{path!r} is empty: not a checkpoint")
                if sniff_file(path) == "safetensors":
                    raise CheckpointFormatError(
                        f"{path!r} is a safetensors file, not a torch.save file: read it with "
                        "deepnvme.load_safetensors (or fill a model with deepnvme.load_into)")
                return torch.load(path, map_location=map_location, weights_only=weights_only)
            spans = storage_spans(read_record_spans(f, path=path, file_size=os.fstat(f.fileno()).st_size))
    except FileNotFoundError as exc:
        raise DeepNVMeIOError.from_oserror(exc, op="open for load", path=path, offset=0,
                                           size=0) from None
    if mmap is None:
        mmap = load_paths(path, cfg).fresh == "mapped"
        log.debug("deepnvme.load: %s read %s", path, "mapped" if mmap else "direct")
    if mmap:
        mapping = map_private(path)
        populate_mapping(mapping, path=path, threads=cfg.intra_op_parallelism)
        views = {key: storage_bytes(mapping[span.offset:span.end])
                 for key, span in spans.items()}
        return _rebuild(path, views, {}, map_location, weights_only)
    with AioHandle(config=cfg) as handle:
        buffers, futures = _prefetch(handle, path, spans)
        try:
            return _rebuild(path, buffers, futures, map_location, weights_only)
        finally:
            wait_all(set(futures.values()))  # no read may target a buffer after this


def _load_striped(vpath: VolumePath, map_location: Any, weights_only: bool,
                  cfg: IOConfig) -> Any:
    """``load`` of a striped file: the zip structures through a file object over the volume,
    the storage records read in parallel over every drive."""
    with AioHandle(config=cfg) as handle:
        f = cast(IO[bytes], StripedReader(handle, vpath, striped_size(vpath)))
        name = str(vpath)
        if f.read(4) != ZIP_MAGIC:
            raise CheckpointFormatError(f"{name!r} is not a torch.save zip archive")
        spans = storage_spans(read_record_spans(f, path=name, file_size=f.seek(0, os.SEEK_END)))
        f.seek(0)
        buffers, futures = _prefetch(handle, vpath, spans)
        try:
            return _rebuild(name, buffers, futures, map_location, weights_only, source=f)
        finally:
            wait_all(set(futures.values()))


_INTERNALS = (("torch._C", "PyTorchFileReader"), ("torch.serialization", "_load"),
              ("torch.serialization", "_weights_only_unpickler"))
_warned_internals = False


def _torch_internals_available() -> bool:
    """Whether this torch still has the private loader pieces the parallel path plugs into.

    They are private; a torch without them gets plain ``torch.load`` (correct, not parallel),
    with one warning, rather than an AttributeError.
    """
    global _warned_internals
    missing = [f"{mod}.{name}" for mod, name in _INTERNALS
               if not hasattr(sys.modules.get(mod) or torch, name)]
    if missing and not _warned_internals:
        _warned_internals = True
        log.warning("deepnvme.load: torch %s lacks %s; falling back to torch.load",
                    torch.__version__, ", ".join(missing))
    return not missing


def _rebuild(path: str, buffers: dict[str, torch.Tensor], futures: dict[str, Future[int]],
             map_location: Any, weights_only: bool, source: IO[bytes] | None = None) -> Any:
    ser = torch.serialization
    try:
        reader = torch._C.PyTorchFileReader(path if source is None else source)
    except RuntimeError as exc:
        raise CheckpointFormatError(f"{path!r}: PyTorch cannot open the archive: {exc}") from None
    wrapped = _PrefetchedReader(reader, buffers, futures, path)
    if weights_only:
        try:
            unpickler = ser._weights_only_unpickler  # type: ignore[attr-defined]  # torch's own, private
            return ser._load(wrapped, map_location, unpickler, encoding="utf-8")
        except pickle.UnpicklingError as exc:
            raise pickle.UnpicklingError(
                f"deepnvme.load refused {path!r} with weights_only=True: {exc}. "
                f"{getattr(ser, 'UNSAFE_MESSAGE', '')} Only pass weights_only=False for a file you trust.") from None
    return ser._load(wrapped, map_location, pickle, encoding="utf-8")
