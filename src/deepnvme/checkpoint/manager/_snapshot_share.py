"""A held snapshot (:mod:`._ranks`): this rank's share copied in ``save()`` without DCP's walk.

DCP's walk of the modules and optimizers (``get_model_state_dict`` and friends) and its local
planning cost the training thread several times the copy of the share itself. Once a save has
been planned, the copy needs neither: :func:`list_tensors` lists the state's tensors cheaply
(each module's parameters and buffers, each optimizer's state, the tensors of the rest), and
the previous save's writer thread recorded which listed tensor each item of this rank's share
is (:class:`SnapshotShare`, matched by storage address, dtype, shape and strides). While the
listing's *signature* (every tensor's place, dtype, shape, strides and, for the modules' and
optimizers' tensors, its address; the structure of the rest) is the recorded one, the same
tensors sit in the same places, so ``save()`` copies them and returns; the writer thread walks,
agrees on the plan and pickles the plain items (taken at ``save()`` by
:func:`._dcp_step.begin_state_dicts`).

When the signature differs (a parameter replaced, a key added) or the state holds what only the
walk reads at its time (a module's extra state, an optimizer's non-tensor state), ``save()``
walks and plans itself, as before, and copies the cached plan's share; when that plan no longer
fits (the structure changed), every tensor of the local plan is copied (once, in fresh memory),
since which of them this rank writes is agreed only later.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from .._arena import ArenaPool, Lease
from ._dcp_step import LocalPlan, PlanCache, Staged, _Later, walk_modules
from ._share_plan import SharePlans
from ._staging import Places, arena_places, stage, stage_tensors

__all__ = ["Listing", "list_tensors", "SnapshotShare", "Snapped"]


@dataclasses.dataclass(frozen=True)
class Listing:
    """The state's tensors in a fixed order and its signature (None: some of the state can
    only be read by DCP's walk, at its time)."""

    signature: tuple[Any, ...] | None
    tensors: list[torch.Tensor]


def _place(t: torch.Tensor, address: bool) -> tuple[Any, ...]:
    return (t.dtype, tuple(t.shape), t.stride(), t.device.type, t.data_ptr() if address else 0)


def list_tensors(state: Mapping[str, Any], begun: Mapping[str, Any]) -> Listing:
    """Every tensor of ``state`` that a save may write, without DCP's walk: ``begun``
    (:func:`._dcp_step.begin_state_dicts`, taken at ``save()``) for the entries other than
    modules and their optimizers, ``state`` for those."""
    sig: list[Any] = []
    tensors: list[torch.Tensor] = []

    def add(where: tuple[Any, ...], t: torch.Tensor, address: bool) -> None:
        if isinstance(t, DTensor):
            t = t.to_local()
        t = t.detach()
        sig.append((where, _place(t, address)))
        tensors.append(t)

    with torch.no_grad():
        for name, entry in begun.items():
            if not isinstance(entry, _Later):
                leaves, spec = tree_flatten(entry)
                sig.append((name, spec))
                for i, leaf in enumerate(leaves):
                    if isinstance(leaf, torch.Tensor):
                        add((name, i), leaf, False)  # taken at save(): a new tensor each time
                continue
            if entry.model is None:
                module = state[name]
                if any(type(m).get_extra_state is not torch.nn.Module.get_extra_state for m in module.modules()):
                    return Listing(None, [])
                for path, t in chain(module.named_parameters(remove_duplicate=False),
                                     module.named_buffers(remove_duplicate=False)):
                    add((name, path), t, True)
                continue
            optim = state[name]
            sig.append((name, tuple(tuple(sorted(s)) for s in entry.settings or ())))
            for i, group in enumerate(optim.param_groups):
                for j, p in enumerate(group["params"]):
                    for key, value in optim.state.get(p, {}).items():
                        if not isinstance(value, torch.Tensor):
                            return Listing(None, [])
                        add((name, i, j, key), value, True)
    return Listing(tuple(sig), tensors)


@dataclasses.dataclass
class Snapped:
    """A share copied in ``save()``: the copies, the arena lease that holds them (None: fresh
    memory) and the local plan when ``save()`` walked (None: the writer thread walks)."""

    staged: Staged
    lease: Lease | None
    local: LocalPlan | None

    def release(self) -> None:
        """Free the copies (the save is written, or failed)."""
        self.staged.clear()
        if self.lease is not None:
            self.lease.release()
            self.lease = None


@dataclasses.dataclass(frozen=True)
class _Sources:
    """Which listed tensor each tensor item of a cached plan's share is, for one signature."""

    cache: PlanCache
    signature: tuple[Any, ...]
    items: list[tuple[MetadataIndex, int]]


class SnapshotShare:
    """Held snapshots of one multi-rank manager on this rank: :meth:`take` in ``save()``,
    :meth:`complete` on the writer thread. ``walked``/``fast``: saves that walked in ``save()``
    and saves that did not."""

    def __init__(self, plans: SharePlans, pool: ArenaPool) -> None:
        self.plans, self.pool = plans, pool
        self._sources: _Sources | None = None  # written by the writer thread, read after settle()
        self.walked = self.fast = 0
        self._kept: tuple[_Sources, torch.Tensor, tuple[int, int], Places] | None = None  # see _places

    def take(self, state: Mapping[str, Any], begun: dict[str, Any], keys: list[str] | None) -> Snapped:
        """``save()``: this rank's share of ``state`` copied (see the module)."""
        listing, src, cache = list_tensors(state, begun), self._sources, self.plans.cache
        if src is not None and src.cache is cache and listing.signature == src.signature:
            tensors = [(index, listing.tensors[at]) for index, at in src.items]
            staged, lease = stage_tensors(tensors, self.pool, lambda arena: self._places(src, arena, tensors))
            self.fast += 1
            return Snapped(staged, lease, None)
        self.walked += 1
        local = self.plans.local(lambda: walk_modules(state, begun), keys)
        if local.error is not None or local.planner is None or local.plan is None:
            return Snapped({}, None, local)  # the writer thread reports the error to every rank
        if cache is not None and local.same_as(cache):
            staged, lease = stage(local.planner, local.planner.finish_plan(cache.final), self.pool)
            return Snapped(staged, lease, local)
        return Snapped(_copy_all(local.planner, local.plan), None, local)

    def _places(self, src: _Sources, arena: torch.Tensor, tensors: list[tuple[MetadataIndex, torch.Tensor]]
                ) -> Places:
        """The share's places in ``arena``, kept from save to save while the sources and the arena
        are the same (their views cost as much CPU as a tenth of the copy)."""
        kept, where = self._kept, (arena.data_ptr(), arena.numel())
        if kept is None or kept[0] is not src or kept[1] is not arena or kept[2] != where:
            kept = self._kept = (src, arena, where, arena_places(arena, [t for _, t in tensors]))
        return kept[3]

    def close(self) -> None:
        """Drop the kept places (they hold the arena's memory)."""
        self._kept = None

    def complete(self, snapped: Snapped, planner: DefaultSavePlanner, mine: SavePlan, cache: PlanCache,
                 state: Mapping[str, Any], begun: Mapping[str, Any]) -> None:
        """The writer thread, once the plan is agreed: the plain items of ``mine`` pickled from
        ``planner`` (over what ``save()`` took), a check that every tensor item was copied, and
        the record of where the share's tensors are for the next ``save()``."""
        for item in mine.items:
            if item.index in snapped.staged:
                continue
            if item.type != WriteItemType.BYTE_IO:
                raise ValueError(f"CheckpointManager.save: {item.index.fqn!r} was not copied at save(): the "
                                 "modules or optimizers changed their structure while the save was taken; "
                                 "save again")
            snapped.staged[item.index] = planner.resolve_data(item)
        self._sources = _sources(list_tensors(state, begun), planner, mine, cache)


def _sources(listing: Listing, planner: DefaultSavePlanner, mine: SavePlan, cache: PlanCache) -> _Sources | None:
    """Where each tensor item of ``mine`` is in ``listing`` (None: one is in none of its places,
    e.g. a view DCP made)."""
    if listing.signature is None:
        return None
    where: dict[tuple[Any, ...], int] = {}
    for at, t in enumerate(listing.tensors):
        where.setdefault(_place(t, True), at)
    items: list[tuple[MetadataIndex, int]] = []
    for item in mine.items:
        if item.type == WriteItemType.BYTE_IO:
            continue
        data = planner.resolve_data(item)
        found = where.get(_place(data.detach(), True)) if isinstance(data, torch.Tensor) else None
        if found is None:
            return None
        items.append((item.index, found))
    return _Sources(cache, listing.signature, items)


def _copy_all(planner: DefaultSavePlanner, plan: SavePlan) -> Staged:
    """Every item of ``plan`` copied into fresh memory (tensors cloned, plain items pickled)."""
    out: dict[MetadataIndex, torch.Tensor | io.BytesIO] = {}
    for item in plan.items:
        data = planner.resolve_data(item)
        out[item.index] = data.detach().clone() if isinstance(data, torch.Tensor) else data
    return out
