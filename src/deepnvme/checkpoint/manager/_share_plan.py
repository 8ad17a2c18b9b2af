"""This rank's plans of its share of a multi-rank step (:mod:`._ranks`): what is saved of the
state, DCP's local plan of it, and the agreement on the global plan, which is kept and reused
with no planning exchange while every rank's structure stays the same."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from ._dcp_step import LocalPlan, PlanCache, begin_state_dicts, local_plan, rng_entry, walk_modules
from ._group import RankGroup
from ._rank_state import pack
from ._rng import capture_rng
from ._steps import RANK_STATE_KEY
from ._votes import describe as _describe
from ._votes import failed as _failed

__all__ = ["SharePlans"]


class SharePlans:
    """The planning of one multi-rank manager's saves on this rank (see the module). ``discard(building)``
    removes a failed save's building folders (a node's lowest rank; no-op on the others);
    ``drives``: the data files of this rank's ``node`` (its group ranks) placed on a volume of
    that many drives (each node places its own ranks' files on its own drives)."""

    def __init__(self, group: RankGroup, rng_key: str, *, drives: int | None,
                 discard: Callable[[str], None], node: tuple[int, ...] | None = None) -> None:
        self.group, self.rng_key, self.drives, self.discard = group, rng_key, drives, discard
        self.node = node
        self.cache: PlanCache | None = None  # the last save's plan, reused while the structure holds
        self.planned = 0  # saves that ran DCP's global planning (and its exchange)

    def begin(self, state: Mapping[str, Any], rng: bool, rank_state: Mapping[str, Any] | None, *,
               copy_plain: bool) -> dict[str, Any]:
        """What is saved of ``state`` before DCP's walk of its modules (:func:`begin_state_dicts`),
        with this rank's RNG states and ``rank_state``."""
        if reserved := [k for k in (self.rng_key, RANK_STATE_KEY) if k in state]:
            raise ValueError(f"CheckpointManager.save: state keys {reserved} are reserved for the manager")
        begun = begin_state_dicts(state, copy_plain=copy_plain)
        if rng:
            begun[self.rng_key] = {rng_entry(self.group.rank): capture_rng()}
        if rank_state is not None:
            begun[RANK_STATE_KEY] = {rng_entry(self.group.rank): pack(rank_state)}
        return begun

    def plan(self, state: Mapping[str, Any], rng: bool, rank_state: Mapping[str, Any] | None) -> LocalPlan:
        """This rank's planner and local plan of ``state`` (the error instead, if planning failed)."""
        return self.local(lambda: walk_modules(state, self.begin(state, rng, rank_state, copy_plain=False)),
                           None if rank_state is None else sorted(rank_state))

    def local(self, saved: Callable[[], dict[str, Any]], keys: list[str] | None) -> LocalPlan:
        """DCP's planner and local plan of what ``saved()`` gives (or why that failed)."""
        try:
            planner, plan = local_plan(saved(), self.group.rank)
        except BaseException as exc:  # reported to every rank by the caller
            return LocalPlan(None, None, keys, exc)
        return LocalPlan(planner, plan, keys, None)

    def agree(self, step: int, building: str, local: LocalPlan, own: BaseException | None, *, thread: str,
               same: bool | None) -> PlanCache:
        """Collective on ``thread``'s group: the global plan of this save. ``same``: whether every
        rank's structure is the cached plan's (from the step vote; None: find out in one exchange,
        which also fails every rank when one could not plan). When it is, the cached plan, with no
        planning exchange (``own``, an error of this rank, then fails the save at the commit
        vote); else DCP's global planning from every rank's local plan, kept for the next saves."""
        g = self.group
        if same is None:
            mine = own is None and local.error is None and self.cache is not None and local.same_as(self.cache)
            said = g.gather((step, mine, _describe(own or local.error)), thread=thread, what=f"save({step}) structure")
            if others := [r for r, v in enumerate(said) if v[0] != step]:
                self.discard(building)
                raise ValueError(f"CheckpointManager.save({step}): ranks {others} passed other steps "
                                 f"({[said[r][0] for r in others]}); every rank saves the same step")
            if any(v[2] is not None for v in said):
                raise self._failed(step, building, [v[2] for v in said], own or local.error)
            same = all(v[1] for v in said)
        if same and self.cache is not None:
            return self.cache
        own = own or local.error
        plans = g.gather((local.plan, _describe(own), local.keys), thread=thread, what=f"save({step}) planning")
        if any(p[1] is not None for p in plans):
            raise self._failed(step, building, [p[1] for p in plans], own)
        cache = self.cache = local.cached([p[0] for p in plans], g.rank,
                                           {rng_entry(r): p[2] for r, p in enumerate(plans) if p[2] is not None},
                                           drives=self.drives, node=self.node)
        self.planned += 1
        return cache

    def _failed(self, step: int, building: str, said: list[Any], own: BaseException | None) -> BaseException:
        """A failed planning on some rank: no plan is reused, the building folder goes; the error."""
        self.cache = None
        self.discard(building)
        return _failed(f"checkpoint step {step} (planning)", said, own)

    @staticmethod
    def finish(step: int, local: LocalPlan, cache: PlanCache) -> tuple[DefaultSavePlanner, SavePlan, Metadata]:
        """This rank's planner, its final plan of the save and a copy of the metadata (whose
        storage_data is set per save)."""
        if local.planner is None:  # not reached: a failed plan raised in agree
            raise RuntimeError(f"CheckpointManager.save({step}): no save planner")
        return local.planner, local.planner.finish_plan(cache.final), dataclasses.replace(cache.metadata)
