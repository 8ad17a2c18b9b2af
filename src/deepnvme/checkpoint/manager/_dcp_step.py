"""A step saved by several ranks: a ``torch.distributed.checkpoint`` checkpoint in ``step-N/``.

The layout is stock DCP (``.metadata`` plus ``__<rank>_<n>.distcp`` data files, written through
:class:`~deepnvme.checkpoint.dcp.NVMeStorageWriter`), so ``torch.distributed.checkpoint.load``
reads it, plus the manager's ``manifest.json`` (step, world size, files and bytes per rank, each
file's checksum with ``checksums=``, the keys of each rank's ``rank_state``).
Planning is DCP's: :class:`DefaultSavePlanner` spreads tensors that several ranks hold
(DDP replicas) over those ranks, each item to the rank with the fewest bytes planned so far, so
each rank writes about 1/W of them; DTensor shards are written by their owners; plain data
that several ranks hold is written once, by the lowest such rank. The helpers here run one
phase each; :mod:`._ranks` runs the phases and the agreement between them.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import json
import os
import time
import warnings
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, cast

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StoragePrefix, _StorageWriterTransforms
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.storage import WriteResult
from torch.utils._pytree import tree_map

from ...config import IOConfig
from ...errors import DeepNVMeError
from ...io.volume import VolumePath
from .._placed import write_placement
from ..dcp import NVMeStorageReader, NVMeStorageWriter
from ..dcp._sums import ItemSums, item_key
from ..dcp._volume import place_plans
from ._checksums import Running, file_checksum
from ._drives import StepDrives
from ._steps import FORMAT, MANIFEST, step_dir

__all__ = ["KIND", "LocalPlan", "PlanCache", "state_dicts", "begin_state_dicts", "walk_modules", "walks_later",
           "load_into", "local_plan", "global_plans",
           "placed_plans", "StagedPlanner", "write_share", "Written", "item_sums",
           "finish_step", "read_step", "ReadHints", "rng_entry"]

KIND = "dcp"  # the manifest's "layout" of a multi-rank step
Staged = dict[MetadataIndex, "torch.Tensor | io.BytesIO"]


def rng_entry(rank: int) -> str:
    """The name of rank ``rank``'s RNG states under the manager's RNG key."""
    return f"rank{rank}"


def _owner(optim: torch.optim.Optimizer, models: list[torch.nn.Module]) -> torch.nn.Module | None:
    """The one module in ``models`` holding every parameter ``optim`` updates (None: none or several)."""
    wanted = {id(p) for group in optim.param_groups for p in group["params"]}
    found = [m for m in models if wanted <= {id(p) for p in m.parameters()}]
    return found[0] if len(found) == 1 else None


def state_dicts(state: Mapping[str, Any]) -> dict[str, Any]:
    """What DCP saves of ``state`` (and loads into): modules' and their optimizers' state dicts by
    parameter name (``get_model_state_dict``/``get_optimizer_state_dict``, so DTensor and
    resharding work), other objects' ``state_dict()``, tensors (detached) and plain data."""
    return walk_modules(state, begin_state_dicts(state, copy_plain=False))


@dataclasses.dataclass(frozen=True)
class _Later:
    """An entry :func:`walk_modules` fills in: a module, or an optimizer a module of the state
    owns (with its param groups' settings as they were at :func:`begin_state_dicts`, or None)."""

    model: torch.nn.Module | None
    settings: list[dict[str, Any]] | None = None


def _copied(value: Any) -> Any:
    """``value`` with its containers and non-tensor leaves copied, its tensors shared (detached)."""
    return tree_map(lambda v: v.detach() if isinstance(v, torch.Tensor) else copy.deepcopy(v), value)


def begin_state_dicts(state: Mapping[str, Any], *, copy_plain: bool) -> dict[str, Any]:
    """The part of :func:`state_dicts` that needs no walk of a module: tensors (detached), other
    objects' ``state_dict()`` and plain data; modules and the optimizers they own are left as
    markers for :func:`walk_modules`. ``copy_plain=True`` (a save whose modules are walked later, on
    the writer thread, while the loop goes on): plain data, ``state_dict()`` results and each
    optimizer's param-group settings (learning rate, betas...) are copied now, tensors shared."""
    models = [v for v in state.values() if isinstance(v, torch.nn.Module)]
    out: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            out[name] = value.detach()
        elif isinstance(value, torch.nn.Module):
            out[name] = _Later(None)
        elif isinstance(value, torch.optim.Optimizer) and (model := _owner(value, models)) is not None:
            settings = [{k: v for k, v in g.items() if k != "params"} for g in value.param_groups]
            out[name] = _Later(model, _copied(settings) if copy_plain else None)
        elif callable(getattr(value, "state_dict", None)):
            out[name] = _copied(value.state_dict()) if copy_plain else value.state_dict()
        else:
            out[name] = _copied(value) if copy_plain else value
    return out


def walks_later(state: Mapping[str, Any]) -> bool:
    """Whether DCP's walk of the modules in ``state`` may run on another thread while the loop
    runs forward and backward passes: not for FSDP modules, whose forward swaps the parameters
    it all-gathers in and out of the module."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return not any(isinstance(m, (FSDPModule, FullyShardedDataParallel))
                   for v in state.values() if isinstance(v, torch.nn.Module) for m in v.modules())


def walk_modules(state: Mapping[str, Any], begun: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`begin_state_dicts`'s result with each module's and owned optimizer's state dict
    (DCP's walk), the optimizer's param-group settings taken from ``begun`` where it kept them."""
    out = dict(begun)
    for name, entry in begun.items():
        if not isinstance(entry, _Later):
            continue
        if entry.model is None:
            out[name] = get_model_state_dict(state[name])
            continue
        optim = get_optimizer_state_dict(entry.model, state[name])
        if entry.settings is not None:
            groups = cast(list[dict[str, Any]], optim["param_groups"])
            if len(groups) != len(entry.settings):
                raise ValueError(f"CheckpointManager.save: optimizer {name!r} changed its param groups "
                                 f"({len(entry.settings)} at save(), {len(groups)} now) before its state was read")
            for group, settings in zip(groups, entry.settings):
                group.update(settings)
        out[name] = optim
    return out


def load_into(state: MutableMapping[str, Any], loaded: Mapping[str, Any], *, strict: bool) -> None:
    """Put what DCP loaded into ``loaded`` (made by :func:`state_dicts`) back into ``state``."""
    models = [v for v in state.values() if isinstance(v, torch.nn.Module)]
    for name, value in list(state.items()):
        if name not in loaded:
            continue
        if isinstance(value, torch.Tensor):
            with torch.no_grad():
                value.copy_(loaded[name])
        elif isinstance(value, torch.nn.Module):
            set_model_state_dict(value, loaded[name], options=StateDictOptions(strict=strict))
        elif isinstance(value, torch.optim.Optimizer) and (model := _owner(value, models)) is not None:
            set_optimizer_state_dict(model, value, loaded[name])
        elif callable(getattr(value, "load_state_dict", None)):
            value.load_state_dict(loaded[name])
        else:
            state[name] = loaded[name]


class _Planner(DefaultSavePlanner):
    """DCP's default save planner, except that plain data (not tensors) that several ranks hold
    is written by the lowest of them rather than spread over them like tensors."""

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        owner: dict[MetadataIndex, int] = {}
        for i, plan in enumerate(all_plans):
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    owner.setdefault(item.index, i)
        trimmed = [dataclasses.replace(plan, items=[it for it in plan.items if it.type != WriteItemType.BYTE_IO
                                                    or owner[it.index] == i])
                   for i, plan in enumerate(all_plans)]
        return super().create_global_plan(trimmed)


def local_plan(saved: dict[str, Any], rank: int) -> tuple[DefaultSavePlanner, SavePlan]:
    """This rank's planner over ``saved`` and its local plan (every item it could write)."""
    planner = _Planner()
    planner.set_up_planner(saved, is_coordinator=rank == 0)
    return planner, planner.create_local_plan()


def global_plans(planner: DefaultSavePlanner, plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """Every rank's final plan (deduplicated, files named ``__<rank>_<n>.distcp``) and the
    checkpoint's metadata, from all ranks' local plans. Deterministic: every rank gets the same."""
    final, metadata = planner.create_global_plan(plans)
    final = [dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_")) for i, plan in enumerate(final)]
    return final, metadata


def placed_plans(final: list[SavePlan], drives: int, ranks: Sequence[int] | None = None
                 ) -> tuple[list[SavePlan], dict[str, int]]:
    """The final plans with each data file of ``ranks`` (None: every rank; one node's ranks)
    given one of ``drives`` drives, balanced by bytes over those ranks' files
    (:func:`..dcp._volume.place_plans`, cut as :func:`write_share`'s writer cuts them), and data
    file -> drive. The other ranks' plans are left as they are. Deterministic."""
    cut = NVMeStorageWriter(os.devnull)  # the writer's defaults: how many files each rank writes
    ranks = range(len(final)) if ranks is None else ranks
    placed, where = place_plans([final[r] for r in ranks], drives, thread_count=cut.thread_count,
                                single_file_per_rank=cut.single_file_per_rank)
    out = list(final)
    for r, plan in zip(ranks, placed):
        out[r] = plan
    return out, where


@dataclasses.dataclass(frozen=True)
class PlanCache:
    """A save's plan kept for the next saves while the state's structure stays the same:
    this rank's local plan and per-rank state keys (what is compared), its final plan, the
    checkpoint's metadata and every rank's per-rank state keys."""

    local: SavePlan
    keys: list[str] | None
    final: SavePlan
    metadata: Metadata
    rank_keys: dict[str, list[str]]
    placed: dict[str, int] = dataclasses.field(default_factory=dict)  # on a volume: data file -> drive


@dataclasses.dataclass(frozen=True)
class LocalPlan:
    """This rank's planner (set up on the state to save) and local plan, or why it failed."""

    planner: DefaultSavePlanner | None
    plan: SavePlan | None
    keys: list[str] | None  # the per-rank state's keys
    error: BaseException | None

    def same_as(self, cache: PlanCache) -> bool:
        """Whether this plan is the cached one: the same items (keys, shapes, dtypes, chunks of
        DTensor shards), the same nesting of the state and the same per-rank state keys."""
        return (self.plan is not None and self.keys == cache.keys and self.plan.items == cache.local.items
                and self.plan.planner_data == cache.local.planner_data)

    def cached(self, plans: list[SavePlan], rank: int, rank_keys: dict[str, list[str]], *,
               drives: int | None = None, node: Sequence[int] | None = None) -> PlanCache:
        """The global plan made from every rank's local ``plans``, kept (see :class:`PlanCache`);
        ``drives``: the data files of ``node``'s ranks (None: all) placed on a volume of that
        many drives."""
        if self.planner is None or self.plan is None:
            raise RuntimeError("a failed local plan has no global plan")
        final, metadata = global_plans(self.planner, plans)
        placed: dict[str, int] = {}
        if drives is not None:
            final, placed = placed_plans(final, drives, node)
        return PlanCache(self.plan, self.keys, final[rank], metadata, rank_keys, placed)


class StagedPlanner(SavePlanner):
    """Hands the staged copies to DCP's writer in place of the live state."""

    def __init__(self, staged: Staged) -> None:
        self.staged = staged

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        raise NotImplementedError("a staged share is written, not planned")

    def create_local_plan(self) -> SavePlan:
        raise NotImplementedError("a staged share is written, not planned")

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        raise NotImplementedError("a staged share is written, not planned")

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        raise NotImplementedError("a staged share is written, not planned")

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        data = self.staged.pop(write_item.index)  # each item is written once; its memory goes with it
        if isinstance(data, io.BytesIO):
            data.seek(0)
        return data


def _writer(building: str | VolumePath, rank: int, config: IOConfig, algorithm: str | None = None
            ) -> NVMeStorageWriter:
    writer = NVMeStorageWriter(building, config=config)
    writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
    if algorithm is not None:
        writer.fs.hashing = functools.partial(Running, algorithm)
    return writer


@dataclasses.dataclass(frozen=True)
class Written:
    """What one rank wrote of a step: DCP's write results, and with checksums on, each file's
    and each item's checksum, computed from the bytes as they were written."""

    results: list[WriteResult]
    file_sums: dict[str, int]
    item_sums: dict[str, int]


def write_share(building: str, plan: SavePlan, source: SavePlanner, *, rank: int, config: IOConfig,
                algorithm: str | None = None, transforms: _StorageWriterTransforms | None = None,
                drives: StepDrives | None = None) -> Written:
    """Write this rank's share into ``building`` (each file fsynced; the directory made if rank
    0 has not yet: with a cached plan no exchange orders them); what it wrote. ``source``
    resolves each item's data (a :class:`StagedPlanner`, or a fenced share's planner, which
    also passes ``transforms`` to hear when each item is written). With ``algorithm``:
    checksums of each file and item, hashed while writing (nothing is read back). ``drives``:
    on a volume, each data file goes to the drive the plan's storage data names, into the
    folder named as ``building`` on that drive."""
    os.makedirs(building, exist_ok=True)
    writer = _writer(building if drives is None else drives.at(building), rank, config, algorithm)
    if transforms is not None:
        writer.transforms = transforms
    results = writer.write_data(plan, source).wait()
    items: dict[str, int] = {}
    for res in results if algorithm is not None else []:
        info = res.storage_data
        found = writer.fs.item_sums.get(os.fspath(info.relative_path), {}).get((info.offset, info.length))
        if found is not None:
            items[item_key(res.index)] = found
    return Written(results, dict(writer.fs.sums), items)


def finish_step(building: str, step: int, metadata: Metadata, written: list[Written],
                config: IOConfig, *, algorithm: str | None = None,
                rank_state: Mapping[str, list[str]] | None = None,
                drives: StepDrives | None = None, placed: Mapping[str, int] | None = None) -> None:
    """Rank 0, after every rank wrote: ``.metadata`` (fsynced, renamed into place) and the
    manifest (fsynced by the publish that follows) in the step's building directory. With
    ``algorithm``: every data file's and item's checksum (computed by the rank that wrote it) and
    ``.metadata``'s. ``rank_state``: the keys of each rank's per-rank state. ``drives``: on a
    volume, the placement record (``placed``: data file -> drive) names the step's final
    folders, and the manifest every file on every drive."""
    results = [w.results for w in written]
    if drives is not None:  # before .metadata names the files; it names the folders as published
        write_placement(drives.across(building), placed or {}, named=[step_dir(f, step) for f in drives.folders])
    _writer(building, 0, config).finish(metadata, results)  # .metadata in drive 0's folder
    where = {n: os.path.join(building, n) for n in os.listdir(building) if n != MANIFEST}
    if drives is not None:
        where |= {n: os.path.join(drives.across(building)[d], n) for n, d in (placed or {}).items()}
    ranks = [{"rank": r, "files": sorted({os.fspath(w.storage_data.relative_path) for w in res}),
              "bytes": sum(w.size_in_bytes for w in res)} for r, res in enumerate(results)]
    manifest: dict[str, Any] = {
        "format": FORMAT, "version": 1, "layout": KIND, "step": step, "time": time.time(),
        "world_size": len(results), "files": {n: os.path.getsize(where[n]) for n in sorted(where)},
        "ranks": ranks}
    if algorithm is not None:
        manifest["checksum"] = algorithm
        manifest["file_checksums"] = {**{n: c for w in written for n, c in w.file_sums.items()},
                                      ".metadata": file_checksum(algorithm, os.path.join(building, ".metadata"))}
        manifest["tensor_checksums"] = {n: c for w in written for n, c in sorted(w.item_sums.items())}
    if rank_state:
        manifest["rank_state"] = dict(rank_state)
    with open(os.path.join(building, MANIFEST), "w", encoding="utf-8") as f:  # publish_dir fsyncs it
        json.dump(manifest, f, indent=1)


def item_sums(manifest: Mapping[str, Any]) -> ItemSums | None:
    """The per-item checksums a step's manifest holds, for its reader (None: none stored)."""
    algorithm, sums = manifest.get("checksum"), manifest.get("tensor_checksums")
    return None if not algorithm or sums is None else ItemSums(algorithm, sums, functools.partial(Running, algorithm))


@dataclasses.dataclass(frozen=True)
class ReadHints:
    """Where a step's data files are when the nodes gathered them (:mod:`._tiers`): ``local``,
    for each data file, the ranks whose node read it from its own storage (a shared read goes to
    one of them); ``present``, files here only in part and their ``(offset, length)`` ranges."""

    local: dict[str, frozenset[int]]
    present: dict[str, list[tuple[int, int]]]


def read_step(path: str | VolumePath, saved: dict[str, Any], *, group: Any, config: IOConfig,
              partial: bool = False, sums: ItemSums | None = None, hints: ReadHints | None = None) -> None:
    """Load the step directory ``path`` (or its folder on a volume) into ``saved`` in place, DCP
    resharding where the saving world differs. ``group``: the (gloo) process group of the
    readers (None: this process alone); what several of them load is read once and broadcast
    over it. ``sums``: items read whole are checked against them (:class:`CheckpointCorruptError`).
    A failure on any rank raises that rank's error (a deepnvme error as it is) on every rank."""
    reader = NVMeStorageReader(path, config=config, share_group=group)
    reader.item_sums = sums
    if hints is not None:
        reader.local, reader.present = hints.local, hints.present
    with warnings.catch_warnings():  # without a group, DCP warns that it assumes one process: it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            dcp_load(saved, storage_reader=reader,
                     planner=DefaultLoadPlanner(allow_partial_load=partial), process_group=group,
                     no_dist=group is None)
        except CheckpointException as exc:
            first = exc.failures[min(exc.failures)][0] if exc.failures else None
            if isinstance(first, DeepNVMeError):
                raise first from exc
            raise
