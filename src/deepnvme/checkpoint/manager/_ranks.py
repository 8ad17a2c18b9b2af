"""The multi-rank half of :class:`~deepnvme.CheckpointManager`: a save, restore and listing that
every rank of the manager's group calls together, the directory shared by all of them.

A save (:meth:`RankSteps.save`, the caller's thread): the ranks vote on the step (rank 0's view
of the committed steps and of the interval rule decides for all); each rank plans with DCP
(:mod:`._dcp_step`), the plans are exchanged and every rank derives the same deduplicated
global plan; each rank copies its share (the snapshot) and returns. On the writer thread: each
rank writes and fsyncs its files into the step's hidden building directory, the ranks vote
(every rank's success or error), then rank 0 writes ``.metadata`` and the manifest, publishes
``step-N`` in one rename and applies retention, and tells the others. A failure on any rank
fails the save on every rank and removes the building directory; earlier steps stay.
"""

from __future__ import annotations

import errno as errno_mod
import logging
import os
import shutil
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ...config import IOConfig
from ...errors import DeepNVMeIOError, DistributedSaveError, FileNotFoundIOError
from ...io import durable
from .._writer import Call, Writer
from ..dcp import NVMeStorageReader
from ._commit import StepCommit
from ._dcp_step import (
    Staged,
    finish_step,
    global_plans,
    load_into,
    local_plan,
    read_step,
    rng_entry,
    stage,
    state_dicts,
    write_share,
)
from ._group import RankGroup
from ._lock import DirectoryLock, tidy, try_lock
from ._rng import capture_rng, restore_rng
from ._steps import building_path, is_dcp_step, list_steps, read_manifest, remove_leftovers, step_dir

__all__ = ["RankSteps", "restore_dcp"]

log = logging.getLogger(__name__)

Failure = tuple[str, str, "int | None"]  # (error type, message, errno) as sent to the other ranks


def _describe(exc: BaseException | None) -> Failure | None:
    if exc is None:
        return None
    return type(exc).__name__, str(exc), exc.errno if isinstance(exc, OSError) else None


def _failed(what: str, votes: list[Failure | None], own: BaseException | None) -> BaseException:
    """One error for every rank: what failed on which rank (an I/O error's errno kept)."""
    bad = [(r, v) for r, v in enumerate(votes) if v is not None]
    text = "; ".join(f"rank {r}: {kind}: {msg}" for r, (kind, msg, _) in bad)
    codes = [code for _, (_, _, code) in bad if code is not None]
    err: BaseException
    if codes:
        err = DeepNVMeIOError(f"{what} failed on rank {', '.join(str(r) for r, _ in bad)} ({text})",
                              path=getattr(own, "filename", None), offset=None, size=None, errno=codes[0])
    else:
        err = DistributedSaveError(f"{what} failed on rank {', '.join(str(r) for r, _ in bad)} ({text})")
    err.__cause__ = own
    return err


class RankSteps:
    """Steps of ``directory`` saved and restored by the ranks of ``group`` together (see the
    module). One thread drives it; rank 0 holds the directory's writer lock while saving."""

    def __init__(self, directory: str, group: RankGroup, *, keep: int | None, config: IOConfig,
                 rng_key: str) -> None:
        self.directory, self.group, self.config, self.rng_key = directory, group, config, rng_key
        self._commit = StepCommit(directory, keep=keep, algorithm=None)  # retention
        self._lock: DirectoryLock | None = None
        self._writer: Writer | None = None
        if group.rank == 0:
            tidy(directory)

    # ---- saving ---------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], *, force: bool, rng: bool,
             rule: Callable[[int | None, float], bool], settle: Callable[[], None], since_last: float,
             last_step: int | None) -> Call | None:
        """Collective: plan and stage this rank's share of ``step``; the writer-thread call that
        writes and commits it, already submitted (None: not due). ``rule(newest, since_last)``
        says whether the step is due; rank 0's answer holds for all. ``settle()`` runs once the
        save is known to be due, before anything else: it waits for the previous save and raises
        its error (the same on every rank, as the ranks agreed on it)."""
        g = self.group
        vote: Any = (step, force)
        if g.rank == 0:
            newest = max([*list_steps(self.directory)[-1:], *([] if last_step is None else [last_step])],
                         default=None)
            bad = newest is not None and step <= newest
            vote = (step, force, None if bad else rule(newest, since_last) or force,
                    f"step {step} is not greater than the newest saved step {newest}" if bad else None,
                    building_path(self.directory, step))
        votes = g.gather(vote, thread="main", what=f"save({step})")
        if others := [r for r, v in enumerate(votes) if v[0] != step]:
            raise ValueError(f"CheckpointManager.save({step}): ranks {others} passed other steps "
                             f"({[votes[r][0] for r in others]}); every rank saves the same step")
        _, _, due, refused, building = votes[0]
        if refused is not None:
            raise ValueError(f"CheckpointManager.save: {refused} in {self.directory!r}")
        if not due:
            return None
        settle()
        own: BaseException | None = None
        plan: SavePlan | None = None
        try:
            if g.rank == 0:
                self._prepare(building)
            saved = state_dicts(state)
            if rng:
                saved[self.rng_key] = {rng_entry(g.rank): capture_rng()}
            planner, plan = local_plan(saved, g.rank)
        except BaseException as exc:  # reported to every rank below
            own = exc
        plans = g.gather((plan, _describe(own)), thread="main", what=f"save({step}) planning")
        if any(p[1] is not None for p in plans):
            if g.rank == 0:
                shutil.rmtree(building, ignore_errors=True)
            raise _failed(f"checkpoint step {step} (planning)", [p[1] for p in plans], own)
        final, metadata = global_plans(planner, [p[0] for p in plans])
        mine = planner.finish_plan(final[g.rank])
        staged: Staged = {}
        try:
            staged = stage(planner, mine)
        except BaseException as exc:  # the writer thread still votes, so no rank waits for this one
            own = exc
        call = Call(fn=lambda: self._write(step, building, mine, staged, metadata, own))
        self._start().submit(call)
        if own is not None:
            raise own
        return call

    def _prepare(self, building: str) -> None:
        """Rank 0: the writer lock (at the first save; leftovers of killed saves removed) and the
        step's building directory."""
        if self._lock is None:
            self._lock = try_lock(self.directory)
            remove_leftovers(self.directory)
        os.mkdir(building)

    def _start(self) -> Writer:
        if self._writer is None:
            self._writer = Writer(self.config, name="deepnvme-checkpoint-ranks-writer")
        return self._writer

    def _write(self, step: int, building: str, plan: SavePlan, staged: Staged, metadata: Metadata,
               own: BaseException | None) -> None:
        """The writer thread: write this rank's share, vote, rank 0 commits, everyone hears."""
        g = self.group
        results: list[WriteResult] = []
        if own is None:
            try:
                results = write_share(building, plan, staged, rank=g.rank, config=self.config)
            except BaseException as exc:
                own = exc
        staged.clear()
        what = f"checkpoint step {step} in {self.directory!r} (earlier steps are intact)"
        votes = g.gather((results, _describe(own)), thread="writer", what=f"step {step} vote")
        if any(v[1] is not None for v in votes):
            if g.rank == 0:
                shutil.rmtree(building, ignore_errors=True)
            raise _failed(what, [v[1] for v in votes], own)
        if g.rank == 0:
            try:
                finish_step(building, step, metadata, [v[0] for v in votes], self.config)
                durable.publish_dir(building, step_dir(self.directory, step))
            except BaseException as exc:
                own = exc
                shutil.rmtree(building, ignore_errors=True)
        outcome = g.gather(_describe(own) if g.rank == 0 else None, thread="writer",
                           what=f"step {step} commit")[0]
        if outcome is not None:
            raise _failed(what, [outcome], own)
        if g.rank == 0:
            self._commit.retire()

    # ---- reading --------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Collective: the committed steps as rank 0 sees them."""
        mine = list_steps(self.directory) if self.group.rank == 0 else None
        steps: list[int] = self.group.gather(mine, thread="main", what="steps()")[0]
        return steps

    def restore(self, state: MutableMapping[str, Any], step: int | None, *, rng: bool, strict: bool,
                single: Callable[[int], None]) -> int:
        """Collective: load ``step`` (None: the newest, as rank 0 sees it) into ``state``.
        ``single(step)`` restores a step saved by one process (each rank reads all of it)."""
        g = self.group
        pick: Any = None
        if g.rank == 0:
            steps = list_steps(self.directory)
            chosen = steps[-1] if step is None and steps else step if step in steps else None
            pick = (chosen, None if chosen is not None else
                    f"{'no checkpoint' if step is None else f'no checkpoint of step {step}'} in "
                    f"{self.directory!r} (committed steps: {steps})")
        chosen, missing = g.gather(pick, thread="main", what="restore()")[0]
        if missing is not None:
            raise FileNotFoundIOError(missing, path=self.directory, offset=None, size=None,
                                      errno=errno_mod.ENOENT)
        path = step_dir(self.directory, chosen)
        if not is_dcp_step(path):
            single(chosen)
            return int(chosen)
        restore_dcp(path, chosen, state, group=g.group("main"), rank=g.rank, world=g.world,
                    rng_key=self.rng_key if rng else None, config=self.config, strict=strict)
        return int(chosen)

    def close(self) -> None:
        """Collective: stop the writer (after the queued saves), wait for every rank, release the
        lock and the groups. The caller raises the saves' errors."""
        try:
            if self._writer is not None:
                self._writer.stop()
            self.group.gather(None, thread="main", what="close()")
        finally:
            if self._lock is not None:
                self._lock.release()
            self.group.close()


def restore_dcp(path: str, step: int, state: MutableMapping[str, Any], *, group: Any, rank: int, world: int,
                rng_key: str | None, config: IOConfig, strict: bool) -> None:
    """Load the multi-rank step at ``path`` into ``state`` (DCP reshards when ``world`` differs
    from the saving world), then this rank's RNG states when ``rng_key`` is given and the world
    size is unchanged (otherwise they are left alone, with a warning)."""
    manifest = read_manifest(path, step)
    saved = state_dicts(state)
    read_step(path, saved, group=group, config=config, partial=not strict)
    load_into(state, saved, strict=strict)
    if rng_key is None:
        return
    if manifest.get("world_size") != world:
        log.warning("deepnvme.CheckpointManager: step %d was saved by %s ranks, restored by %d: RNG "
                    "states are left as they are", step, manifest.get("world_size"), world)
        return
    entry = {rng_entry(rank): capture_rng()}
    stored = NVMeStorageReader(path, config=config).read_metadata().state_dict_metadata
    if not any(key.startswith(f"{rng_key}.{rng_entry(rank)}.") for key in stored):
        return  # saved with rng=False
    holder = {rng_key: entry}
    read_step(path, holder, group=None, config=config)
    restore_rng(holder[rng_key][rng_entry(rank)])
