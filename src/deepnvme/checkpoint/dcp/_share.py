"""Reading a checkpoint once for several ranks: what many ranks load is read by one of them and
broadcast to the others over a process group.

When every rank of a load asks for the same bytes (replicated tensors of a DDP job, plain data,
a DTensor replicated over a mesh dimension), reading them on each rank reads the storage W times.
Instead, the coordinator (:func:`schedule`, in ``prepare_global_plan``) finds the read requests
that two or more ranks make, identical in storage item, offsets and lengths, and gives each to
one of those ranks, balancing the bytes each reads. Every rank then (:func:`share_read`) reads
its own requests from storage, the ranks agree that all reads succeeded, and each shared request
is broadcast from its reader in the schedule's order, straight into the receivers' tensors where
dtype and shape allow. Requests of one rank alone are read as before.

Memory: receivers need a buffer only where a target is not a contiguous CPU tensor of the saved
dtype, and ranks that take part in a broadcast they do not need (a subset of the ranks asked for
it) receive into scratch memory; small requests (under ``_PACK_MAX`` bytes) travel packed, one
buffer per reading rank.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

__all__ = ["Entry", "Schedule", "schedule", "share_read"]

_PACK_MAX = 1 << 20  # requests under this many bytes are broadcast packed together, per reader
_ALIGN = 16  # bytes: where each packed request starts

Key = tuple[LoadItemType, MetadataIndex, tuple[int, ...], tuple[int, ...]]


def key_of(req: ReadItem) -> Key:
    """What identifies the bytes a request loads (not where they go)."""
    return req.type, req.storage_index, tuple(req.storage_offsets), tuple(req.lengths)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One request that several ranks make: who reads it and what travels."""

    key: Key
    src: int  # the rank (of the load's group) that reads it from storage
    nbytes: int  # bytes broadcast
    dtype: torch.dtype | None  # the saved dtype of a tensor request; None: bytes


@dataclasses.dataclass(frozen=True)
class Schedule:
    """The shared requests of one load, in broadcast order; the same on every rank."""

    entries: tuple[Entry, ...]

    def srcs(self) -> dict[Key, int]:
        return {e.key: e.src for e in self.entries}


def schedule(plans: list[LoadPlan], metadata: Metadata,
             local: Mapping[str, frozenset[int]] | None = None) -> list[LoadPlan]:
    """Every plan with a :class:`Schedule` of the requests several ranks make as its
    ``storage_data`` (plans unchanged where no request is shared). ``local``: for data files
    that only some ranks read from their own storage, those ranks (a file not named: every
    rank); a shared request goes to one of them when any asks for it. Deterministic."""
    needed: dict[Key, list[int]] = {}
    for rank, plan in enumerate(plans):
        for req in plan.items:
            ranks = needed.setdefault(key_of(req), [])
            if not ranks or ranks[-1] != rank:
                ranks.append(rank)
    shared = [k for k, ranks in needed.items() if len(ranks) > 1]
    if not shared:
        return plans
    info = metadata.storage_data
    shared.sort(key=lambda k: (str(info[k[1]].relative_path), info[k[1]].offset, k[2]))
    load = [0] * len(plans)
    entries = []
    for k in shared:
        nbytes, dtype = _size(k, metadata)
        near = needed[k]
        if local is not None and (held := local.get(str(info[k[1]].relative_path))) is not None:
            near = [r for r in near if r in held] or near
        src = min(near, key=lambda r: (load[r], r))
        load[src] += nbytes
        entries.append(Entry(k, src, nbytes, dtype))
    sched = Schedule(tuple(sorted(entries, key=lambda e: e.src)))  # stable: file order per reader
    return [dataclasses.replace(plan, storage_data=sched) for plan in plans]


def _size(k: Key, metadata: Metadata) -> tuple[int, torch.dtype | None]:
    kind, index, _offsets, lengths = k
    if kind == LoadItemType.BYTE_IO:
        return int(metadata.storage_data[index].length), None
    md = metadata.state_dict_metadata[index.fqn]
    if not isinstance(md, TensorStorageMetadata):
        raise ValueError(f"{index.fqn!r}: a tensor read of an entry saved as bytes")
    dtype = md.properties.dtype
    return math.prod(lengths) * dtype.itemsize, dtype


class _Capture(LoadPlanner):
    """The reading rank's planner: loads into the real targets and keeps what others need
    (each shared tensor as a contiguous tensor of the saved dtype, each shared bytes item)."""

    def __init__(self, planner: LoadPlanner, entries: dict[Key, Entry]) -> None:
        self.planner, self.entries = planner, entries
        self.kept: dict[Key, torch.Tensor] = {}
        self._targets: dict[int, torch.Tensor] = {}

    def set_up_planner(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("a capturing planner only loads")

    def create_local_plan(self) -> LoadPlan:
        raise NotImplementedError("a capturing planner only loads")

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        raise NotImplementedError("a capturing planner only loads")

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        raise NotImplementedError("a capturing planner only loads")

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        k = key_of(read_item)
        if k in self.entries:
            data = value.getvalue()
            self.kept[k] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(
                0, dtype=torch.uint8)
            value = io.BytesIO(data)
        self.planner.load_bytes(read_item, value)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target: torch.Tensor = self.planner.resolve_tensor(read_item)
        entry = self.entries.get(key_of(read_item))
        if entry is None or _direct(target, entry):
            return target
        buf = torch.empty(tuple(read_item.lengths), dtype=entry.dtype)
        if buf.numel():  # keyed by address: the reader commits a detached view of it
            self._targets[buf.data_ptr()] = target
        return buf

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        k = key_of(read_item)
        target = self._targets.pop(tensor.data_ptr(), None) if tensor.numel() else None
        if k in self.entries:
            self.kept[k] = tensor
        if target is not None:
            with torch.no_grad():
                target.copy_(tensor)
            tensor = target
        self.planner.commit_tensor(read_item, tensor)


def _direct(target: torch.Tensor, entry: Entry) -> bool:
    """Whether ``target`` can be broadcast from or into as it is."""
    return (target.device.type == "cpu" and target.dtype == entry.dtype and target.is_contiguous()
            and target.numel() * target.element_size() == entry.nbytes)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).view(torch.uint8)


def share_read(plan: LoadPlan, planner: LoadPlanner, sched: Schedule, *, rank: int, group: Any,
               read: Callable[[LoadPlan, LoadPlanner], None],
               agree: Callable[[BaseException | None], None]) -> None:
    """Load ``plan`` on this rank with the shared requests read once (see the module): ``read``
    loads a plan from storage, ``agree(error)`` tells every rank whether every rank's reads
    succeeded (raising where not), then the shared requests are broadcast over ``group``.
    Collective over ``group``; blocks."""
    srcs = sched.srcs()
    own = [r for r in plan.items if srcs.get(key_of(r), rank) == rank]
    mine = {e.key: e for e in sched.entries if e.src == rank}
    capture = _Capture(planner, mine)
    failed: BaseException | None = None
    try:
        read(dataclasses.replace(plan, items=own), capture)
    except BaseException as exc:  # every rank hears of it before any broadcast
        failed = exc
    agree(failed)
    wanted: dict[Key, list[ReadItem]] = {}
    for req in plan.items:
        if srcs.get(key_of(req), rank) != rank:
            wanted.setdefault(key_of(req), []).append(req)
    _exchange(sched.entries, capture.kept, wanted, planner, rank=rank, group=group)


def _exchange(entries: Sequence[Entry], kept: dict[Key, torch.Tensor], wanted: dict[Key, list[ReadItem]],
              planner: LoadPlanner, *, rank: int, group: Any) -> None:
    """Broadcast every entry from its reader (large ones alone, small ones packed per reader),
    all posted at once; then load what this rank wanted into its targets."""
    works: list[Any] = []
    landed: list[tuple[Entry, torch.Tensor]] = []  # (entry, its bytes here) for what this rank wanted
    by_src: dict[int, list[Entry]] = {}
    for e in entries:
        by_src.setdefault(e.src, []).append(e)
    gsrc = {r: dist.get_global_rank(group, r) for r in by_src}
    for src, group_entries in by_src.items():
        small = [e for e in group_entries if e.nbytes < _PACK_MAX]
        for e in (e for e in group_entries if e.nbytes >= _PACK_MAX):
            if src == rank:
                buf = _flat(kept[e.key])
            else:
                buf = _receiver(e, wanted.get(e.key), planner)
                if e.key in wanted:
                    landed.append((e, buf))
            works.append(dist.broadcast(buf, gsrc[src], group=group, async_op=True))
        if not small:
            continue
        starts = [0]
        for e in small:  # each start aligned for any dtype's view
            starts.append(starts[-1] + -(-e.nbytes // _ALIGN) * _ALIGN)
        packed = torch.empty(starts[-1], dtype=torch.uint8)
        for e, at in zip(small, starts):
            if src == rank and e.nbytes:
                packed[at:at + e.nbytes].copy_(_flat(kept[e.key]))
            elif e.key in wanted:
                landed.append((e, packed[at:at + e.nbytes]))
        if packed.numel():
            works.append(dist.broadcast(packed, gsrc[src], group=group, async_op=True))
    for work in works:
        work.wait()
    for e, data in landed:
        _deliver(e, data, wanted[e.key], planner)


def _receiver(e: Entry, reqs: list[ReadItem] | None, planner: LoadPlanner) -> torch.Tensor:
    """Where this rank receives ``e``: its first target's bytes if the target fits, else new memory."""
    if reqs and e.dtype is not None:
        target = planner.resolve_tensor(reqs[0])
        if _direct(target, e):
            return _flat(target)
    return torch.empty(e.nbytes, dtype=torch.uint8)


def _deliver(e: Entry, data: torch.Tensor, reqs: list[ReadItem], planner: LoadPlanner) -> None:
    """Load the received bytes of ``e`` into each request's target (bytes: ``load_bytes``)."""
    if e.dtype is None:
        raw = data.numpy().tobytes() if data.numel() else b""
        for req in reqs:
            planner.load_bytes(req, io.BytesIO(raw))
        return
    value = data.view(e.dtype).view(tuple(reqs[0].lengths))
    for req in reqs:
        target = planner.resolve_tensor(req)
        if target.data_ptr() != value.data_ptr():
            with torch.no_grad():
                target.copy_(value)
        planner.commit_tensor(req, target)
