"""The multi-rank half of :class:`~deepnvme.CheckpointManager`: a save, restore and listing that
every rank of the manager's group calls together, in one directory all ranks share or one per
node (:mod:`._nodes`; :mod:`._tiers`: restore across the nodes, their replicas and the durable tier).

A save (:meth:`RankSteps.save`, the caller's thread): the ranks vote on the step (rank 0's view
of the committed steps and of the interval rule decides for all); each rank plans with DCP and
the ranks agree on the global plan, reused with no planning exchange while the structure holds
(:mod:`._share_plan`); each rank copies its share (the snapshot) and returns. A save of state
without FSDP modules is *held* (a snapshot: after the manager's first save): DCP's walk and the
plan agreement run on the writer thread while the loop goes on; a snapshot's share is copied in
``save()`` from the tensors the previous save found (:mod:`._snapshot_share`), a fenced save is
staged there and the next optimizer step waits until it is. On the
writer thread: each rank writes and fsyncs its files into the step's hidden building directory,
the ranks vote (every rank's success or error, and its checksums, computed while writing), then
rank 0 writes ``.metadata`` and the manifest, publishes ``step-N`` in one rename, applies
retention and tells the others. A failure on any rank fails the save on every rank and removes
the building directory; earlier steps stay.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from ...config import IOConfig
from ...io import durable
from ...memory.heap import trim_heap
from .._arena import ArenaPool, Lease
from .._writer import Call, Writer
from ._commit import StepCommit
from ._dcp_restore import restore_dcp
from ._dcp_step import (
    LocalPlan,
    Staged,
    StagedPlanner,
    Written,
    finish_step,
    walk_modules,
    walks_later,
    write_share,
)
from ._drives import StepDrives, take_directory
from ._fenced_share import ShareFence, ShareFences
from ._group import RankGroup
from ._lock import DirectoryLock, tidy
from ._node_folders import NodeFolders
from ._nodes import Layout, publish_nodes, retire_nodes
from ._rank_reads import RankReads
from ._share_plan import SharePlans
from ._snapshot_share import Snapped, SnapshotShare
from ._staging import stage
from ._steps import (
    building_path,
    list_steps,
    new_token,
    step_dir,
)
from ._tiers import Tiers
from ._votes import describe as _describe
from ._votes import failed as _failed

__all__ = ["RankSteps", "restore_dcp"]  # restore_dcp: re-exported for the single-process manager

log = logging.getLogger(__name__)

PHASES = ("staging", "writing", "agreement", "rename", "retention")


def _no_hook(phase: str) -> None:
    """Where a save has got to (one of :data:`PHASES`); tests replace :data:`at_phase` to stop a job there."""


at_phase: Callable[[str], None] = _no_hook


class RankSteps(RankReads):
    """Steps of ``directory`` saved and restored by the ranks of ``group`` together (see the
    module). One thread drives it; rank 0 holds the directory's writer lock while saving."""

    def __init__(self, directory: str, group: RankGroup, *, keep: int | None, config: IOConfig,
                 rng_key: str, algorithm: str | None = None, layout: Layout | None = None,
                 tiers: Tiers | None = None, after_commit: Callable[[int], None] | None = None,
                 closing: Callable[[], None] | None = None, fences: ShareFences | None = None,
                 drives: StepDrives | None = None) -> None:
        self.directory, self.group, self.config, self.rng_key = directory, group, config, rng_key
        self.algorithm = algorithm  # per-file checksums (None: off), see _dcp_step.file_sums
        self.drives = drives  # on a volume: data files placed on its drives (each node on its own)
        self._commit = StepCommit(directory, keep=keep, algorithm=None, drives=drives)  # retention
        self._lock: DirectoryLock | None = None
        self._writer: Writer | None = None
        # nodes and tiers (_nodes, _tiers): None for one directory shared by every rank, no tiers
        self.layout = layout or Layout(rank=group.rank, nodes=(tuple(range(group.world)),))
        self.tiers, self.after_commit, self.closing = tiers, after_commit, closing
        self._token: str | None = None  # rank 0's, from the last vote: the building folders' names
        self._held_last = False  # whether the last due save was held (its writer may replace the cached plan)
        self.plans = SharePlans(group, rng_key, drives=None if drives is None else len(drives.folders),
                                node=self.layout.nodes[self.layout.node],
                                discard=lambda building: self._discard(building) if self.layout.leader else None)
        # one staging arena for every save: settle() waits for the previous write before staging
        self._arenas = ArenaPool(1, what="CheckpointManager staging arenas")
        self.fences = fences  # fenced staging (:mod:`._fenced_share`); None: snapshots
        self.snapshots = SnapshotShare(self.plans, self._arenas)  # held snapshots (:mod:`._snapshot_share`)
        if self.layout.leader:
            tidy(directory, remove=None if drives is None else drives.remove_leftovers)

    # ---- saving ---------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], *, force: bool, rng: bool,
             rule: Callable[[int | None, float], bool], settle: Callable[[], None], since_last: float,
             last_step: int | None, rank_state: Mapping[str, Any] | None = None,
             by_step: bool = False) -> Call | None:
        """Collective: plan and stage this rank's share of ``step``; the submitted writer-thread call
        that writes and commits it (None: not due). ``rule(newest, since_last)``: whether the step
        is due (rank 0's answer holds for all; ``by_step``: it depends on the step alone). ``settle()``
        runs once the save is due, first: it waits for the previous save and raises its error (the
        same on every rank). ``rank_state``: this rank's own entries, kept apart (:mod:`._rank_state`)."""
        g = self.group
        # the walk may run on the writer thread (a snapshot's: after the first save, which plans in save())
        held = (self.fences is not None or self._token is not None) and walks_later(state)
        if held and by_step and last_step is not None and self._token is not None:  # all decide alike: no vote
            return self._save_held(step, state, force=force, rng=rng, rule=rule, settle=settle,
                                   last_step=last_step, rank_state=rank_state)
        # the structure is compared with the cached plan's before the vote when the save looks
        # due here, so that a steady-state save needs no planning exchange (see _agree)
        plans = self.plans
        # after a held save, whose writer may still replace the cache, the structure is not compared early
        early = not held and not self._held_last and plans.cache is not None and (force or rule(last_step, since_last))
        local = plans.plan(state, rng, rank_state) if early else None
        same = local is not None and local.error is None and plans.cache is not None and local.same_as(plans.cache)
        vote: Any = (step, force, same, held)
        if g.rank == 0:
            newest = max([*list_steps(self.directory)[-1:], *([] if last_step is None else [last_step])],
                         default=None)
            bad = newest is not None and step <= newest
            vote = (step, force, same, held, None if bad else rule(newest, since_last) or force,
                    f"step {step} is not greater than the newest saved step {newest}" if bad else None,
                    new_token())
        votes = g.gather(vote, thread="main", what=f"save({step})")
        if others := [r for r, v in enumerate(votes) if v[0] != step]:
            raise ValueError(f"CheckpointManager.save({step}): ranks {others} passed other steps "
                             f"({[votes[r][0] for r in others]}); every rank saves the same step")
        due, refused, self._token = votes[0][4:]
        building = building_path(self.directory, step, self._token)  # this node's
        if refused is not None:
            raise ValueError(f"CheckpointManager.save: {refused} in {self.directory!r}")
        if not due:
            return None
        settle()
        own: BaseException | None = None
        try:
            if self.layout.leader:
                self._prepare(building)
        except BaseException as exc:  # reported to every rank below
            own = exc
        self._held_last = all(v[3] for v in votes)  # alike on every rank
        if self._held_last:
            call, own = self._hold(step, building, state, rng, rank_state, own)
        else:
            call, own = self._stage(step, building, state, local or plans.plan(state, rng, rank_state), own,
                                    same=all(v[2] for v in votes))
        self._start().submit(call)
        if own is not None:
            raise own
        return call

    def _save_held(self, step: int, state: Mapping[str, Any], *, force: bool, rng: bool,
                   rule: Callable[[int | None, float], bool], settle: Callable[[], None], last_step: int,
                   rank_state: Mapping[str, Any] | None) -> Call | None:
        """A held save decided here, with no collective on this thread: after a save of this
        manager, whether a step is due depends on the step alone (no ``every_seconds``), so every
        rank decides alike (``force`` and ``step`` must be the same on every rank, which the
        writer thread's exchange checks). An error of this rank here is not raised: that exchange
        reports it to every rank at ``wait()`` or the next due save, so that every rank counts
        the save alike."""
        if step <= last_step:
            raise ValueError(f"CheckpointManager.save: step {step} is not greater than the newest saved step "
                             f"{last_step} in {self.directory!r}")
        if not (force or rule(last_step, 0.0)):  # the time since the last save does not count
            return None
        settle()
        building, own = building_path(self.directory, step, self._token), None  # every rank's alike
        try:
            if self.layout.leader:
                self._prepare(building)
        except BaseException as exc:  # reported by the writer thread
            own = exc
        call, _ = self._hold(step, building, state, rng, rank_state, own)
        self._held_last = True
        self._start().submit(call)
        return call

    def _hold(self, step: int, building: str, state: Mapping[str, Any], rng: bool,
              rank_state: Mapping[str, Any] | None, own: BaseException | None) -> tuple[Call, BaseException | None]:
        """A held save (see the module): only what the loop may change before its next optimizer
        step (fenced), or its share (a snapshot, :mod:`._snapshot_share`), is taken here;
        :meth:`_write_held` does the rest. The call and this rank's error."""
        keys, begun = None if rank_state is None else sorted(rank_state), {}
        snapped: Snapped | None = None
        try:
            begun = self.plans.begin(state, rng, rank_state, copy_plain=True)
            if self.fences is None and own is None:
                at_phase("staging")
                snapped = self.snapshots.take(state, begun, keys)
        except BaseException as exc:  # heard by every rank on the writer thread
            own = own or exc
        gate = None if self.fences is None else self.fences.hold(state)
        return Call(fn=lambda: self._write_held(step, building, state, begun, keys, gate, snapped, own)), own

    def _stage(self, step: int, building: str, state: Mapping[str, Any], local: LocalPlan,
               own: BaseException | None, *, same: bool) -> tuple[Call, BaseException | None]:
        """Agree on the plan and stage this rank's share here (a snapshot, or a fence when not
        held); the writer-thread call that writes and commits it, and this rank's error (voted there)."""
        cache = self.plans.agree(step, building, local, own, thread="main", same=same)
        planner, mine, metadata = self.plans.finish(step, local, cache)
        staged: Staged = {}
        lease: Lease | None = None
        fence: ShareFence | None = None
        try:
            at_phase("staging")
            if self.fences is not None:  # nothing copied but small items: the live tensors are written
                fence = self.fences.stage(planner, mine, state)
            else:
                staged, lease = stage(planner, mine, self._arenas)
        except BaseException as exc:  # the writer thread still votes, so no rank waits for this one
            own = own or exc
        return Call(fn=lambda: self._write(step, building, mine, staged, lease, fence, metadata, own,
                                           cache.rank_keys, cache.placed)), own

    def _write_held(self, step: int, building: str, state: Mapping[str, Any], begun: dict[str, Any],
                    keys: list[str] | None, gate: threading.Event | None, snapped: Snapped | None,
                    own: BaseException | None) -> None:
        """The writer thread, for :meth:`_hold`: walk (unless ``save()`` did), agree on the plan,
        stage the fence and let the held optimizer step go on (or finish the snapshot), then
        write and commit as :meth:`_write`."""
        fence: ShareFence | None = None
        try:
            local = LocalPlan(None, None, keys, own) if own is not None else \
                snapped.local if snapped is not None and snapped.local is not None else \
                self.plans.local(lambda: walk_modules(state, begun), keys)
            cache = self.plans.agree(step, building, local, None, thread="writer", same=None)
            planner, mine, metadata = self.plans.finish(step, local, cache)
            try:
                at_phase("staging")
                if self.fences is not None:
                    fence = self.fences.stage(planner, mine, state)
                elif snapped is not None:
                    self.snapshots.complete(snapped, planner, mine, cache, state, begun)
            except BaseException as exc:  # voted below, so every rank fails the save
                own = exc
        except BaseException:
            if snapped is not None:
                snapped.release()
            raise
        finally:
            if gate is not None and self.fences is not None:
                self.fences.release(gate)
        staged, lease = ({}, None) if snapped is None else (snapped.staged, snapped.lease)
        self._write(step, building, mine, staged, lease, fence, metadata, own, cache.rank_keys, cache.placed)

    def _prepare(self, building: str) -> None:
        """A node's lowest rank: the writer lock (at the first save; leftovers of killed saves
        removed) and the step's building directory."""
        if self._lock is None:
            self._lock = take_directory(self.directory, self.drives)
        os.makedirs(building, exist_ok=True)  # a rank's writer may have made it (a cached plan)

    def _start(self) -> Writer:
        if self._writer is None:
            self._writer = Writer(self.config, name="deepnvme-checkpoint-ranks-writer")
        return self._writer

    def _write(self, step: int, building: str, plan: SavePlan, staged: Staged, lease: Lease | None,
               fence: ShareFence | None, metadata: Metadata, own: BaseException | None,
               rank_keys: dict[str, list[str]], placed: dict[str, int]) -> None:
        """The writer thread: write this rank's share (the snapshot ``staged`` in the arena
        ``lease``, or the live tensors behind ``fence``; checksummed as written), end the fence,
        free the arena, vote, rank 0 commits, everyone hears."""
        g = self.group
        written = Written([], {}, {})
        try:
            if own is None:
                source = StagedPlanner(staged) if fence is None else fence.planner()
                written = write_share(building, plan, source, rank=g.rank, config=self.config,
                                      algorithm=self.algorithm,
                                      transforms=None if fence is None else fence.transforms(),
                                      drives=self.drives)
                at_phase("writing")  # written and fsynced, not agreed
        except BaseException as exc:
            own = exc
        finally:  # before any collective: an optimizer step waiting at the fence goes on
            staged.clear()
            if lease is not None:  # written (or failed): the arena is free for the next save
                lease.release()
            if fence is not None and self.fences is not None:
                self.fences.ended(fence)
        what = f"checkpoint step {step} in {self.directory!r} (earlier steps are intact)"
        try:
            if len(self.layout.nodes) > 1:  # each node publishes its own directory
                self._commit_nodes(step, building, metadata, written, own, rank_keys, placed, what)
            else:
                self._commit_one(step, building, metadata, written, own, rank_keys, placed, what)
        finally:
            # a save's transient pieces (plans, pickles, exchange buffers) are freed on several
            # threads' malloc arenas, which keep them: resident memory grew 2-4 % over 100-300
            # saves (none with MALLOC_ARENA_MAX=1); trimming costs about 1 ms on this thread
            trim_heap()
        if self.after_commit is not None:
            self.after_commit(step)

    def _commit_one(self, step: int, building: str, metadata: Metadata, written: Written,
                    own: BaseException | None, rank_keys: dict[str, list[str]], placed: dict[str, int],
                    what: str) -> None:
        """One directory for all ranks: rank 0 collects the votes, publishes when all succeeded,
        and announces the outcome (two collectives, one hop each). On a volume the step's folder
        on each other drive is published before drive 0's, which lists the step."""
        g = self.group
        votes = g.collect((written, _describe(own)), thread="writer", what=f"step {step} vote")
        at_phase("agreement")
        outcome = None
        if votes is not None:  # rank 0
            if any(v[1] is not None for v in votes):
                self._discard(building)
                outcome = [v[1] for v in votes]
            else:
                try:
                    finish_step(building, step, metadata, [v[0] for v in votes], self.config,
                                algorithm=self.algorithm, rank_state=rank_keys, drives=self.drives, placed=placed)
                    at_phase("rename")
                    if self.drives is None:
                        durable.publish_dir(building, step_dir(self.directory, step))
                    else:
                        self.drives.publish(building, step)
                except BaseException as exc:
                    own = exc
                    self._discard(building, step)
                    outcome = [_describe(exc)]
        outcome = g.announce(outcome, thread="writer", what=f"step {step} commit")
        if outcome is not None:
            raise _failed(what, outcome, own)
        if g.rank == 0:
            at_phase("retention")
            self._commit.retire()

    def _discard(self, building: str, step: int | None = None) -> None:
        """Remove a failed save's building folders (on a volume: on every drive, and the step's
        folders published on other drives while drive 0's is not)."""
        if self.drives is None:
            shutil.rmtree(building, ignore_errors=True)
        else:
            self.drives.discard(building, step)

    def _commit_nodes(self, step: int, building: str, metadata: Metadata, written: Written,
                      own: BaseException | None, rank_keys: dict[str, list[str]], placed: dict[str, int],
                      what: str) -> None:
        """One directory (or volume) per node: every rank hears every vote, each node's leader
        publishes (``placed``: on a volume, this node's data files -> drive)."""
        g = self.group
        votes = g.gather((written, _describe(own)), thread="writer", what=f"step {step} vote")
        at_phase("agreement")
        if any(v[1] is not None for v in votes):
            if self.layout.leader:
                self._discard(building)
            raise _failed(what, [v[1] for v in votes], own)
        folders = NodeFolders(self.directory, self.drives)
        failures, own = publish_nodes(g, self.layout, folders=folders, building=building, step=step,
                                      finish=lambda: finish_step(
                                          building, step, metadata, [v[0] for v in votes], self.config,
                                          algorithm=self.algorithm, rank_state=rank_keys), placed=placed)
        if any(failures):
            raise _failed(what, failures, own)
        at_phase("retention")
        retire_nodes(g, self.layout, folders, self._commit.keep)

    def close(self) -> None:
        """Collective: stop the writer (after the queued saves), wait for every rank, release the
        lock and the groups. The caller raises the saves' errors."""
        drained: BaseException | None = None
        try:
            if self._writer is not None:
                self._writer.stop()
            if self.fences is not None:
                self.fences.close()
            if self.closing is not None:  # the tiers' background work (_tiered)
                try:
                    self.closing()
                except BaseException as exc:
                    drained = exc
            self.group.gather(None, thread="main", what="close()")
        finally:
            if self._lock is not None:
                self._lock.release()
            self.snapshots.close()
            self._arenas.close()
            self.group.close()
        if drained is not None:
            raise drained

