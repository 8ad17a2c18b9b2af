"""torch.distributed.checkpoint storage with the deepnvme engine underneath.

:class:`NVMeStorageWriter` and :class:`NVMeStorageReader` are PyTorch's own
``FileSystemWriter``/``FileSystemReader`` (same planners, same file format, same
``.metadata``), so checkpoints stay readable by stock DCP; the byte movement changes, and each
save names its data files afresh so that saving over a checkpoint is all-or-nothing:

* writes: DCP's serializer streams each data file through a few reused aligned buffers that
  the engine writes (O_DIRECT) to a temporary name while the next fills; the file is then
  fsynced and atomically renamed (the directory fsynced too). Memory bound:
  ``_WRITE_BUFFERS x _WRITE_CHUNK`` bytes per writer thread.
* reads: a large tensor item is probed (its zip's head and tail) and only the slice the load
  plan asks for is read, straight into the planner's target when it is one contiguous run;
  other items are read whole, neighbours coalesced into spans (up to ``_READ_SPAN`` bytes) in
  reused buffers, and each tensor is copied from its span into the target (``torch.load`` only
  for items the parser in :mod:`._io` does not know); up to ``_READ_AHEAD`` bytes in
  flight. Memory bound: ``_READ_BUFFERS x _READ_SPAN`` bytes plus the largest item read whole.

Use with ``dcp.save(state, storage_writer=NVMeStorageWriter(path))`` and
``dcp.load(state, storage_reader=NVMeStorageReader(path))`` on every rank.
"""

from __future__ import annotations

import dataclasses
import io
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from ...config import IOConfig, checkpoint_config
from ...errors import CheckpointCorruptError, CheckpointFormatError
from ...handles.aio import AioHandle
from ...io import durable
from ...io.volume import Volume, VolumePath
from ...memory.views import byte_view
from .._placed import read_placement, write_placement
from ._io import (
    RunningHash,
    SavedTensor,
    StreamingWriteStream,
    TensorLayout,
    coalesce,
    copy_saved,
    parse_saved_tensor,
)
from ._read import PROBE_MIN, Job, SliceJob, SpanJob, SpanPool, probe_layouts, run_jobs
from ._share import Schedule, schedule, share_read
from ._sums import ItemSums
from ._volume import PlacedPrefix, file_queue, place_plans, remove_unnamed, volume_home

__all__ = ["NVMeStorageWriter", "NVMeStorageReader"]

_WRITE_CHUNK = 8 << 20  # bytes per write buffer; _WRITE_BUFFERS of them per writer thread
_WRITE_BUFFERS = 3
_READ_GAP = 256 << 10  # a hole up to this many bytes between items is read rather than split
_READ_SPAN = 8 << 20  # most bytes of neighbouring whole items read by one request (one pooled buffer)
_READ_BUFFERS = 8  # pooled span buffers
_READ_AHEAD = 256 << 20  # most bytes in flight (span buffers and slices read into their targets)


class _EngineFileSystem(FileSystem):
    """DCP's local FileSystem with data files written and read by the deepnvme engine."""

    def __init__(self, config: IOConfig) -> None:
        self.config = config
        self._handle: AioHandle | None = None
        self._lock = threading.Lock()  # DCP's writer threads share this file system
        self.replacing = False  # set during finish(): rm_file before a rename onto it is skipped
        self._pool: list[torch.Tensor] = []  # write buffers, reused by the next stream
        self.hashing: Callable[[], RunningHash] | None = None  # set: checksums as written, of
        self.sums: dict[str, int] = {}  # each file by name
        self.item_sums: dict[str, dict[tuple[int, int], int]] = {}  # each item: name -> (offset, length) ->

    def handle(self) -> AioHandle:
        """The shared handle, made on first use (again after :meth:`close`)."""
        with self._lock:
            if self._handle is None:
                self._handle = AioHandle(config=self.config)
            return self._handle

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        path = os.fspath(path)
        if "w" not in mode:
            with super().create_stream(path, mode) as plain:
                yield plain
            return
        with self._lock:
            pool = self._pool
        running = None if self.hashing is None else self.hashing()
        stream = StreamingWriteStream(self.handle, path, pool, chunk=_WRITE_CHUNK,
                                      buffers=_WRITE_BUFFERS, running=running, item_hashing=self.hashing)
        try:
            yield stream
        except BaseException as exc:
            stream.abort()  # a failed serialization must not leave a partial file
            if stream.error is not None and stream.error is not exc:  # the cause, not torch.save's
                raise stream.error from None  # follow-on "unexpected pos" of its zip writer
            raise
        stream.close()
        if running is not None:
            with self._lock:
                self.sums[os.path.basename(path)] = running.value()
                self.item_sums[os.path.basename(path)] = stream.item_sums

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
        with self._lock:
            self._pool = []


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

    On a :class:`~deepnvme.Volume` (or ``vol / "name"``) each data file lies whole on one drive,
    balanced by bytes over all ranks' files (:mod:`._volume`); ``.metadata`` on drive 0.
    """

    fs: _EngineFileSystem

    def __init__(self, path: str | os.PathLike[str] | Volume | VolumePath, *,
                 config: IOConfig | Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        kwargs["sync_files"] = False  # our streams fsync themselves; never os.sync()
        self.folders, home = volume_home(path)
        super().__init__(home, **kwargs)
        self.fs = _EngineFileSystem(checkpoint_config(config))
        self.path = self.fs.init_path(home)
        self._placed: dict[str, int] = {}

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """Name this save's files apart from the previous save's (one token for all ranks);
        on a volume, give each data file its drive."""
        token = secrets.token_hex(4)
        plans = [dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_{token}_"))
                 if plan.storage_data is None else plan for i, plan in enumerate(plans)]
        if self.folders is None:
            return plans
        plans, self._placed = place_plans(plans, len(self.folders), thread_count=self.thread_count,
                                          single_file_per_rank=self.single_file_per_rank)
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        if self.folders is not None and isinstance(plan.storage_data, PlacedPrefix):
            fut = self._write_data(planner, file_queue(
                plan, self.folders, thread_count=self.thread_count,
                single_file_per_rank=self.single_file_per_rank))
        else:
            fut = super().write_data(plan, planner)
        fut.add_done_callback(lambda _: self.fs.close())  # every rank; runs now if already done
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self.folders is not None:  # before .metadata names the files
            write_placement(self.folders, self._placed)
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
        remove_unnamed(self.folders or (os.fspath(self.path),), named)


class NVMeStorageReader(FileSystemReader):
    """``FileSystemReader`` that reads each needed byte range in parallel with the engine.

    ``share_group``: a process group of the load's ranks, in the same order as the group
    ``dcp.load`` runs on, that carries CPU tensors (gloo): bytes that several ranks load (replicated
    tensors, plain data) are then read by one of them and broadcast to the others (see
    :mod:`._share`), so the storage serves them once. Every rank passes the same kind of group.
    ``path`` may be a :class:`~deepnvme.Volume` or a folder on one, saved there by
    :class:`NVMeStorageWriter`: each data file is read on its drive, the drives at once.
    """

    fs: _EngineFileSystem

    def __init__(self, path: str | os.PathLike[str] | Volume | VolumePath, *,
                 config: IOConfig | Mapping[str, Any] | None = None, share_group: Any = None) -> None:
        folders, home = volume_home(path)
        super().__init__(home)
        self.fs = _EngineFileSystem(checkpoint_config(config))
        self.path = self.fs.init_path(home)
        #: on a volume: where each data file lies (read from drive 0's placement record)
        self.placement = read_placement(folders) if folders else None
        self.share_group = share_group
        self.item_sums: ItemSums | None = None  # set: items read whole are checked against these
        #: data files some ranks read from their own storage: those ranks (:func:`._share.schedule`)
        self.local: dict[str, frozenset[int]] | None = None
        #: data files present only in part: their ``(offset, length)`` ranges; an item outside
        #: them is a CheckpointFormatError rather than a read of the file's holes
        self.present: dict[str, list[tuple[int, int]]] | None = None
        self._metadata: Metadata | None = None

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._metadata = metadata

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """With a ``share_group``: each request several ranks make is given to one of them."""
        if self.share_group is None or self._metadata is None or len(plans) < 2:
            return plans
        return schedule(plans, self._metadata, self.local)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> TorchFuture[None]:
        """Read the plan's items with the engine and load each into the planner's target:
        large tensor items by probing their layout and reading only the slice asked for (into
        the target itself where it is one contiguous run), the rest whole, neighbours coalesced
        into spans; ``_READ_AHEAD`` bytes in flight, span buffers reused (see ``._read``).
        Requests shared with other ranks come over the ``share_group`` (a collective then)."""
        if self.share_group is not None and isinstance(plan.storage_data, Schedule):
            share_read(plan, planner, plan.storage_data, rank=dist.get_rank(self.share_group),
                       group=self.share_group, read=self._read_plan, agree=self._agree)
        else:
            self._read_plan(plan, planner)
        fut: TorchFuture[None] = TorchFuture()
        fut.set_result(None)
        return fut

    def _agree(self, failed: BaseException | None) -> None:
        """Every rank's read outcome to every rank; if any rank failed, raise on each: one
        :class:`CheckpointCorruptError` naming the ranks and items when a checksum failed, else
        the rank's own error where it failed and a :class:`CheckpointFormatError` elsewhere."""
        said: list[Any] = [None] * dist.get_world_size(self.share_group)
        dist.all_gather_object(said, None if failed is None else (type(failed).__name__, str(failed)),
                               group=self.share_group)
        bad = [(r, s) for r, s in enumerate(said) if s is not None]
        if not bad:
            return
        text = "; ".join(f"rank {r}: {msg}" for r, (_, msg) in bad)
        if any(kind == CheckpointCorruptError.__name__ for _, (kind, _) in bad):
            raise CheckpointCorruptError(f"reading the checkpoint: {text}") from failed
        if failed is not None:
            raise failed
        raise CheckpointFormatError(f"reading the checkpoint failed on another rank ({text})")

    def _read_plan(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        try:
            handle = self.fs.handle()
            jobs: list[Job] = []
            for path, items in self._items_per_file(plan).items():
                jobs += self._file_jobs(handle, path, items, planner)
            on_volume = self.placement is not None  # the files of every drive advance together
            jobs.sort(key=lambda job: (job.start, job.path) if on_volume else (job.path, job.start))
            run_jobs(handle, jobs, pool=SpanPool(span=_READ_SPAN, buffers=_READ_BUFFERS),
                     ahead=_READ_AHEAD)
        finally:
            self.fs.close()

    def _items_per_file(self, plan: LoadPlan) -> dict[str, list[tuple[ReadItem, Any]]]:
        """The plan's items with their storage info, by data file path; CheckpointFormatError
        if an item lies past the end of its file."""
        by_name: dict[str, list[tuple[ReadItem, Any]]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            name = os.fspath(info.relative_path)
            if self.present is not None and name in self.present and not any(
                    a <= info.offset and info.offset + info.length <= a + n for a, n in self.present[name]):
                raise CheckpointFormatError(
                    f"{name!r} is here only in part and lacks bytes {info.offset}..{info.offset + info.length} "
                    f"of {req.storage_index.fqn!r}: the ranges gathered from other nodes do not match this load")
            by_name.setdefault(name, []).append((req, info))
        paths = ({n: os.fspath(self.fs.concat_path(self.path, n)) for n in by_name}
                 if self.placement is None else self.placement.check(by_name))
        per_file = {paths[n]: items for n, items in by_name.items()}
        for path, items in per_file.items():
            size = os.stat(path).st_size
            for req, info in items:
                if info.offset + info.length > size:
                    raise CheckpointFormatError(
                        f"{path!r} holds {size} bytes but {req.storage_index.fqn!r} is stored at "
                        f"bytes {info.offset}..{info.offset + info.length}: the file is truncated "
                        "or does not belong to this .metadata")
        return per_file

    def _file_jobs(self, handle: AioHandle, path: str, items: list[tuple[ReadItem, Any]],
                   planner: LoadPlanner) -> list[Job]:
        """Slice reads for the probed tensor items of one file, spans for the others."""
        probed = [i for i, (req, info) in enumerate(items)
                  if req.type == LoadItemType.TENSOR and not info.transform_descriptors
                  and info.length >= PROBE_MIN]
        windows: list[tuple[memoryview, memoryview]] = []
        layouts = probe_layouts(handle, path, [(items[i][1].offset, items[i][1].length)
                                               for i in probed], windows) if probed else []
        jobs: list[Job] = []
        sliced = set()
        for i, layout, window in zip(probed, layouts, windows):
            if layout is not None:
                jobs.append(_slice_job(path, *items[i], layout, planner, self._whole_check(items[i], layout, window)))
                sliced.add(i)
        whole = [i for i in range(len(items)) if i not in sliced]
        extents = [(items[i][1].offset, items[i][1].length) for i in whole]

        def load(k: int, data: torch.Tensor) -> None:
            req, info = items[whole[k]]
            self._load_item(req, info, data, planner)

        jobs += [SpanJob(path, span, extents, load)
                 for span in coalesce(extents, gap=_READ_GAP, cap=_READ_SPAN)]
        return jobs

    def _whole_check(self, item: tuple[ReadItem, Any], layout: TensorLayout,
                     window: tuple[memoryview, memoryview]) -> Callable[[torch.Tensor], None] | None:
        """With ``item_sums``: the check of a probed item from its storage record's bytes and its
        probe windows (which hold the rest of the item); None where they do not cover it."""
        sums, (req, info), (head, tail) = self.item_sums, item, window
        end, tail_start = layout.record + layout.record_length, info.length - len(tail)
        if sums is None or layout.record > len(head) or end < tail_start:
            return None
        name = os.fspath(info.relative_path)
        return lambda record: sums.check(req.storage_index, name, head[:layout.record], record,
                                         tail[end - tail_start:])

    def _load_item(self, req: ReadItem, info: Any, data: torch.Tensor, planner: LoadPlanner) -> None:
        """Deserialize one item from its bytes: tensors parsed in place and copied into the
        planner's target (``torch.load`` for anything the parser does not know), bytes as-is."""
        if self.item_sums is not None:
            self.item_sums.check(req.storage_index, os.fspath(info.relative_path), data)
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(bytes(byte_view(data))))
            return
        target = planner.resolve_tensor(req).detach()
        saved = None if info.transform_descriptors else parse_saved_tensor(data)
        if saved is not None:
            copy_saved(saved, req.storage_offsets, req.lengths, target)
        else:
            stream = self.transforms.transform_load_stream(
                req, info.transform_descriptors or (), io.BytesIO(bytes(byte_view(data))))
            loaded = torch.load(io.BytesIO(stream.read(-1)), map_location="cpu", weights_only=True)
            part = narrow_tensor_by_index(loaded, req.storage_offsets, req.lengths)
            if target.size() != part.size():
                raise CheckpointFormatError(f"{req.storage_index.fqn!r}: the saved slice has size "
                                            f"{tuple(part.size())}, the target {tuple(target.size())}")
            target.copy_(part)
        planner.commit_tensor(req, target)


def _slice_job(path: str, req: ReadItem, info: Any, layout: TensorLayout,
               planner: LoadPlanner, check: Callable[[torch.Tensor], None] | None = None) -> SliceJob:
    """The read of ``req``'s slice of a probed tensor item; CheckpointFormatError if the saved
    tensor does not hold that slice."""

    def copy(data: torch.Tensor, target: torch.Tensor) -> None:
        part = SavedTensor(data, layout.dtype, 0, tuple(req.lengths), layout.stride)
        copy_saved(part, [0] * len(req.lengths), req.lengths, target)

    try:
        return SliceJob(path, info.offset, layout, req.storage_offsets, req.lengths,
                        resolve=lambda: planner.resolve_tensor(req).detach(), copy=copy,
                        commit=lambda target: planner.commit_tensor(req, target),
                        check=check)
    except ValueError as exc:
        raise CheckpointFormatError(f"{path!r}: {req.storage_index.fqn!r} (the item at byte "
                                    f"{info.offset}) does not hold the slice to load: {exc}") from None
