"""``deepnvme.CheckpointManager``: the checkpoint loop of a training job in one object.

Where checkpoints go (``DIR/step-N``, see :mod:`._steps`), which are due (orbax's interval
rule), how many stay (``keep``), the newest complete one after a crash, bit-exact resume
(state dicts, tensors, plain data and RNG states) and optional per-tensor checksums. Saves are
asynchronous: a stager (:mod:`.._staging`: ``"snapshot"`` copies the tensors at ``save()``,
``"fenced"`` copies them only at the next optimizer step where needed) makes the image, the
background writer (:mod:`.._writer`) writes and fsyncs it, and the step commit
(:mod:`._commit`) writes the manifest, publishes the step and applies retention.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

import torch

from ...config import IOConfig, checkpoint_config
from ...errors import CheckpointFormatError, CheckpointMismatchError, FileNotFoundIOError
from ...io.volume import Volume, VolumePath
from .._paths import as_path
from .._staging import Staged, Stager, StagingStats
from .._writer import Job, Ledger, Writer
from ._checksums import hasher, record_names, resolve_algorithm
from ._commit import PendingStep, StepCommit, explain_failure
from ._drives import open_drives, take_directory
from ._group import rank_group
from ._lock import DirectoryLock, tidy
from ._options import rank_staging, resolve_manager_stager
from ._policy import check_policy, is_due
from ._rank_state import check_restore_arg, check_save_arg
from ._restore import restore_file
from ._rng import capture_rng
from ._stats import SaveStats
from ._steps import FILE, RANK_STATE_KEY, is_dcp_step, list_steps, step_dir
from ._tiered import check_tier_options, open_tiers
from ._verify import load_checked

if TYPE_CHECKING:
    from ._ranks import RankSteps

__all__ = ["CheckpointManager", "SaveStats", "RNG_KEY"]

log = logging.getLogger(__name__)

RNG_KEY = "_deepnvme_rng"  # the reserved entry holding RNG states in a saved checkpoint


class CheckpointManager:
    """Saves ``state`` dicts of a training loop into ``directory`` asynchronously and restores them.

    ``state`` (for :meth:`save` and :meth:`restore`) maps names to modules, optimizers, LR
    schedulers (anything with ``state_dict()``), tensors and plain data that
    ``torch.load(weights_only=True)`` reads back (builtins, containers; other classes once
    registered with ``torch.serialization.add_safe_globals``); a save holding anything else fails
    at its ``wait()``. One thread drives a manager; one manager may write a directory at a time
    (:class:`CheckpointLockedError` for a second); reading needs no lock and creates nothing (the
    directory and its lock file are made at the first save). Steps are committed as
    ``directory/step-<N, 12 digits>``; :meth:`steps` lists a step once its background write
    committed (:meth:`wait` for the save in flight).

    Args:
        directory: where the steps live (created, with missing parents, at the first save); a
            :class:`~deepnvme.Volume` or a folder on one (``vol / "ckpts"``) places each step's
            ``state.pt`` whole on one drive, balanced by bytes, with the step tree in drive 0's
            folder; over several ranks, each DCP data file whole on one drive of its node's
            volume, with ``replicas=2`` too (see docs/checkpoints.md, "On a volume").
        keep: newest committed steps kept; older ones are removed after a newer one commits
            (None: keep all).
        every_steps: ``save()`` writes when ``step % every_steps == 0`` (None: no step rule).
        every_seconds: ``save()`` writes when this many seconds passed since the last save
            started (None: no time rule). Neither rule: every call writes; both: either one.
        staging: how a save gets its image of the tensors: ``"snapshot"`` (copy every tensor at
            ``save()``; the loop may change them at once), ``"fenced"`` (no copy at ``save()``;
            the next optimizer step copies what is not written yet; CPU tensors only), or a
            :class:`~deepnvme.checkpoint.SnapshotStager` / :class:`~deepnvme.checkpoint.FencedStager`
            with its own options. The manager closes it.
        checksums: per-tensor checksums in the manifest, checked on every read: False, True
            (``"crc32c"``), ``"crc32c"`` or ``"xxh64"``.
        rng: save the RNG states (torch, CUDA when initialised, Python, NumPy) and restore them.
        config: I/O settings of the writer and readers (default: the checkpoint profile).
        group: the torch.distributed group whose ranks share this manager (None: the world;
            every rank of the world constructs its manager, as ``new_group`` requires).
            With torch.distributed initialised and more than one rank, ``save``, ``restore``,
            ``steps``, ``latest_step`` and ``close`` are collectives that every rank calls in
            the same order, ``directory`` is one directory all ranks see, and a step is a
            ``torch.distributed.checkpoint`` checkpoint (see docs/checkpoints.md, "Several
            ranks"; ``checksums`` are per file and per item there); ``"snapshot"`` copies this rank's
            share, ``"fenced"`` writes it from the live tensors (``precopy`` is single-process only).
        timeout: seconds a rank waits for the others in the manager's own collectives before a
            :class:`~deepnvme.RanksTimeoutError` naming the ranks that did not arrive.
        replicas: 2: each rank's files of a step are also kept on another node (several ranks,
            one ``directory`` or volume per node; see docs/checkpoints.md, "Tiers").
        durable: a directory every rank sees (NFS, Lustre): every ``durable_every``-th committed
            step is copied there in the background, ``keep_durable`` of them kept (None: all);
            ``restore`` falls back to it when the nodes lack a step.

    ``mode``, ``snapshot_arenas``, ``fence_staging_bytes`` and ``fence_precopy`` are still
    accepted, with a ``DeprecationWarning``: they map onto ``staging`` (``SnapshotStager(arenas=)``,
    ``FencedStager(staging_bytes=, precopy=)``).
    """

    def __init__(self, directory: str | os.PathLike[str] | Volume | VolumePath, *, keep: int | None = 3,
                 every_steps: int | None = None, every_seconds: float | None = None,
                 staging: str | Stager | None = None, checksums: bool | str = False,
                 rng: bool = True, config: IOConfig | Mapping[str, Any] | None = None,
                 group: Any = None, timeout: float = 600.0, replicas: int = 1,
                 durable: str | os.PathLike[str] | None = None, durable_every: int = 1,
                 keep_durable: int | None = None, **legacy: Any) -> None:
        check_policy(keep=keep, every_steps=every_steps, every_seconds=every_seconds)
        lasting = None if durable is None else os.path.abspath(as_path(durable, "CheckpointManager(durable=)"))
        check_tier_options(replicas=replicas, durable=lasting, durable_every=durable_every,
                           keep_durable=keep_durable)
        self._drives = open_drives(directory)
        stager = resolve_manager_stager(staging, legacy)
        self.directory = (self._drives.home if self._drives is not None
                          else os.path.abspath(as_path(directory, "CheckpointManager",
                                                       "a str or os.PathLike directory, or a Volume")))
        self.keep, self.every_steps, self.every_seconds = keep, every_steps, every_seconds
        self.stager, self.rng = stager, rng
        self._algorithm = resolve_algorithm(checksums)
        self._hash_fn = None if self._algorithm is None else hasher(self._algorithm)
        self._config = checkpoint_config(config)
        self._lock: DirectoryLock | None = None
        self._writer: Writer | None = None
        self._commit = StepCommit(self.directory, keep=keep, algorithm=self._algorithm, drives=self._drives)
        self._ledger = Ledger()
        self._pending: list[Job] = []
        self._last_step: int | None = None
        self._last_start = time.monotonic()
        self._closed = False
        self._saves, self._blocked, self._last_write = 0, 0.0, 0.0
        ranks = rank_group(group, timeout, extra=("durable",) if lasting else ())
        fenced = None if ranks is None else rank_staging(stager, ranks.world)
        self._ranks: RankSteps | None
        self._ranks, self._drainer = open_tiers(  # several ranks: their steps; one process: its durable tier
            ranks, self.directory, keep=keep, config=self._config, rng_key=RNG_KEY, algorithm=self._algorithm,
            replicas=replicas, durable=lasting, durable_every=durable_every, keep_durable=keep_durable,
            fenced=fenced, drives=self._drives)
        if ranks is None:  # leftovers of killed runs, if no writer holds the directory
            tidy(self.directory, remove=None if self._drives is None else self._drives.remove_leftovers)

    @property
    def mode(self) -> str:
        """The stager's ``name``: ``"snapshot"``, ``"fenced"``, or a custom stager's own."""
        return self.stager.name

    # ---- saving -------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], *, force: bool = False,
             rank_state: Mapping[str, Any] | None = None) -> bool:
        """Start saving ``state`` as ``step`` if it is due (or ``force``); False if not due.
        ``rank_state``: entries of this rank alone (a data loader's position, a generator's
        state), kept per rank and given back by ``restore(rank_state=...)`` at the same world size.

        Returns once the loop may go on (snapshot: after the copy; fenced: at once). Raises
        ``ValueError`` for a step not greater than the newest saved or started one, the error of
        an earlier failed save not yet reported, and a :class:`DeepNVMeIOError` naming the step
        when writing the file's skeleton fails here (a full disk); a save that fails here is not
        counted (its step may be saved again; ``every_seconds`` still counts from the last save
        that started writing, timed from the start of its ``save()`` call).
        """
        start, started = time.perf_counter(), time.monotonic()
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"CheckpointManager.save: step must be an int >= 0, got {step!r}")
        own = check_save_arg(rank_state)
        if self._ranks is not None:
            return self._save_ranks(self._ranks, step, state, force, start, started, own)
        self._raise_failures()
        committed = list_steps(self.directory)
        newest = max([*committed[-1:], *([] if self._last_step is None else [self._last_step])], default=None)
        if newest is not None and step <= newest:
            raise ValueError(f"CheckpointManager.save: step {step} is not greater than the newest saved "
                             f"step {newest} in {self.directory!r}")
        due = is_due(step, first=newest is None, every_steps=self.every_steps,
                     every_seconds=self.every_seconds, seconds_since_last=started - self._last_start)
        if not (due or force):
            return False
        saved = self._collect(state)
        if own is not None:
            saved[RANK_STATE_KEY] = own
        writer = self._start_writer()
        pending, staged = self._stage(step, saved, state)
        # only a save that got this far counts: a failed one neither blocks its step nor the clock
        self._last_start, self._last_step = started, step
        job = Job(file=pending.file, staged=staged, hash_fn=self._hash_fn,
                  commit=functools.partial(self._committed, pending),
                  abort=functools.partial(self._commit.abort, pending),
                  check=lambda _file: self._commit.check(pending))
        self._pending.append(job)
        self._ledger.add(job.future)
        writer.submit(job)
        self._saves += 1
        self._blocked += time.perf_counter() - start
        return True

    def _save_ranks(self, ranks: RankSteps, step: int, state: Mapping[str, Any], force: bool, start: float,
                    started: float, rank_state: dict[str, Any] | None) -> bool:
        """``save`` over several ranks (:mod:`._ranks`): the ranks agree on the step and plan
        together; this rank stages its share and its writer thread writes and commits it. A due
        save first waits for the previous one, so every rank raises its error at the same call."""
        call = ranks.save(step, state, force=force, rng=self.rng, settle=self.wait,
                          rule=lambda newest, since: is_due(step, first=newest is None, every_steps=self.every_steps,
                                                            every_seconds=self.every_seconds, seconds_since_last=since),
                          since_last=started - self._last_start, last_step=self._last_step,
                          rank_state=rank_state, by_step=self.every_seconds is None)
        if call is None:
            return False
        self._last_start, self._last_step = started, step
        self._ledger.add(call.future)
        self._saves += 1
        self._blocked += time.perf_counter() - start
        return True

    def _committed(self, pending: PendingStep, written: Any) -> None:
        """The writer thread: commit the step, then hand it to the durable tier."""
        self._commit.commit(pending, written)
        if self._drainer is not None:
            self._drainer.offer(pending.step)

    def _collect(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """What is saved: state dicts of objects, tensors (detached), plain data, RNG states."""
        saved: dict[str, Any] = {}
        for name, value in state.items():
            if not isinstance(name, str) or name in (RNG_KEY, RANK_STATE_KEY):
                raise ValueError(f"CheckpointManager.save: state keys must be str other than {RNG_KEY!r} and "
                                 f"{RANK_STATE_KEY!r}, "
                                 f"got {name!r}")
            if isinstance(value, torch.Tensor):
                saved[name] = value.detach()
            elif callable(getattr(value, "state_dict", None)):
                saved[name] = value.state_dict()
            else:
                saved[name] = value
        if self.rng:
            saved[RNG_KEY] = capture_rng()
        return saved

    def _start_writer(self) -> Writer:
        if self._writer is None:
            self._lock = take_directory(self.directory, self._drives)
            self._writer = Writer(self._config, name="deepnvme-checkpoint-writer")
        return self._writer

    def _stage(self, step: int, saved: Mapping[str, Any], state: Mapping[str, Any]
               ) -> tuple[PendingStep, Staged]:
        """On the caller's thread: the step's building directory, its skeleton and staged image."""
        begun: tuple[str, int | None, str | None] | None = None
        staged: Staged | None = None
        try:
            begun = self._commit.begin(step)
            staged = self.stager.stage(saved, os.path.join(begun[0], FILE), state=state)
            names, order = record_names(saved, staged.layout)
        except BaseException as exc:
            if staged is not None:
                staged.release()
            if begun is not None:
                self._commit.discard(step, *begun)
            if isinstance(exc, OSError):  # e.g. ENOSPC while writing the skeleton: name the step
                raise explain_failure(exc, step, self.directory) from exc
            raise
        building, drive, home = begun
        if self._drives is not None and drive is not None:  # in flight: counted with its tensors' bytes
            self._drives.placed(step, drive, staged.layout.nbytes)
        return PendingStep(step, building, staged.layout, names, order, drive=drive, home=home), staged

    # ---- completion -----------------------------------------------------------------------

    def wait(self) -> None:
        """Block until every save started so far is committed; raise the first failure not
        reported yet (the next ``wait()`` or ``save()`` raises the others)."""
        self._ledger.wait()
        self._raise_failures()

    def _raise_failures(self) -> None:
        done = [job for job in self._pending if job.future.done()]
        self._pending = [job for job in self._pending if not job.future.done()]
        for job in done:
            self._last_write = job.write_seconds or self._last_write
        try:
            self._ledger.raise_first()
        except BaseException:
            self._last_step = max(list_steps(self.directory), default=None)
            raise

    def close(self) -> None:
        """Wait for pending saves, then release the thread, staging memory, hooks and lock
        (idempotent). Raises the first failure not reported yet, after releasing everything;
        the others are logged."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._writer is not None:
                self._writer.stop()
            if self._ranks is not None:
                self._ranks.close()
            if self._drainer is not None:
                self._drainer.close()  # copies the last offered step
            self.wait()
        finally:
            for exc in self._ledger.unreported():
                log.error("deepnvme.CheckpointManager: a save failed and was never reported: %s", exc)
            self.stager.close()
            if self._lock is not None:
                self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
            return
        try:
            self.close()
        except Exception as err:  # the body's exception is the one to see
            log.error("deepnvme.CheckpointManager: a save failed while closing: %s", err)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"CheckpointManager({self.directory!r}) is closed")

    @property
    def stats(self) -> SaveStats:
        """Cumulative cost of this manager's saves to the caller (see :class:`SaveStats`)."""
        st = self.stager.stats()
        if self._ranks is not None and (fences := self._ranks.fences) is not None:  # fenced over ranks
            st = StagingStats(fence_wait_seconds=fences.fence_wait, copied_bytes=fences.copied())
        return SaveStats(saves=self._saves, blocked_seconds=self._blocked + st.fence_wait_seconds,
                         fence_wait_seconds=st.fence_wait_seconds, arena_wait_seconds=st.arena_wait_seconds,
                         last_write_seconds=self._last_write, fence_copied_bytes=st.copied_bytes,
                         fence_precopied_bytes=st.precopied_bytes)

    # ---- reading --------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """The committed steps, ascending. A step is listed once its background write committed
        (only complete checkpoints are ever listed): call :meth:`wait` first to see a save still
        in flight."""
        if self._ranks is not None:
            return self._ranks.steps()
        lasting = [] if self._drainer is None else list_steps(self._drainer.path)
        return sorted(set(list_steps(self.directory)) | set(lasting))

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        return max(self.steps(), default=None)

    def load(self, step: int | None = None, *, map_location: Any = None) -> dict[str, Any]:
        """The saved entries of ``step`` (default: the newest) by name: state dicts for objects,
        tensors and plain data, as passed to ``save`` (the RNG states are :meth:`restore`'s).
        Verifies sizes and any stored checksums (:class:`CheckpointCorruptError`). Blocks; waits
        for this manager's pending saves."""
        if self._writer is not None and not self._closed:
            self.wait()
        chosen = self._resolve(step)
        if is_dcp_step(self._path(chosen)):
            raise CheckpointFormatError(f"step {chosen} in {self.directory!r} was saved by several ranks (a "
                                        "torch.distributed.checkpoint checkpoint): restore(state) reads it")
        obj, _ = load_checked(self._path(chosen), chosen, map_location=map_location,
                              config=self._config, drives=self._folders)
        if not isinstance(obj, dict):
            raise CheckpointMismatchError(f"step {chosen} in {self.directory!r} holds a {type(obj).__name__}")
        obj.pop(RNG_KEY, None)
        obj.pop(RANK_STATE_KEY, None)
        return obj

    def restore(self, state: MutableMapping[str, Any], step: int | None = None, *, strict: bool = True,
                rank_state: MutableMapping[str, Any] | str | None = None) -> int:
        """Load ``step`` (default: the newest) into ``state`` in place and return the step.
        ``rank_state``: a mapping updated in place with this rank's ``save(rank_state=...)``
        entries when the world size is the saving one; at another world size a saved per-rank
        state is a :class:`CheckpointMismatchError` naming its keys unless ``rank_state="skip"``.

        Objects get ``load_state_dict``, tensors ``copy_``, plain data replaces ``state[name]``;
        RNG states are restored when saved and ``rng=True``. The names of ``state`` and the
        checkpoint must match, and so must the names and shapes of a module's state dict
        (:class:`CheckpointMismatchError` before anything changes). ``strict=False`` restores
        part of a checkpoint: names (and module state dict keys) on one side only are left
        out, e.g. a model restored without its optimizer; shapes must still match. Bytes are read straight
        into the existing tensors (parameters, buffers, optimizer state, tensors in ``state``)
        where dtype and shape match, else into new memory (:mod:`._restore`); O_DIRECT lands
        in a tensor directly only when it is page-aligned, as PyTorch makes allocations of 2 MiB
        and more when the process runs with ``THP_MEM_ALLOC_ENABLE=1``. Stored checksums
        are checked on the bytes read: a :class:`CheckpointCorruptError` then comes after the
        state's tensors were overwritten, as can an I/O error.
        """
        check_restore_arg(rank_state)
        if (self._writer is not None or self._ranks is not None) and not self._closed:
            self.wait()
        if (ranks := self._ranks) is not None:
            return ranks.restore(state, step, rng=self.rng, strict=strict, rank_state=rank_state,
                                 single=lambda n: self._restore_file(n, state, strict, rank_state, ranks.group.world))
        chosen = self._resolve(step)
        if is_dcp_step(self._path(chosen)):  # saved by several ranks: resharded into one
            from ._ranks import restore_dcp

            restore_dcp(self._path(chosen), chosen, state, group=None, rank=0, world=1,
                        rng_key=RNG_KEY if self.rng else None, config=self._config, strict=strict,
                        rank_state=rank_state, verify=True, drives=self._drives)
        else:
            self._restore_file(chosen, state, strict, rank_state, 1)
        return chosen

    def _restore_file(self, chosen: int, state: MutableMapping[str, Any], strict: bool, rank_state: Any,
                      world: int) -> None:
        """Restore the single-process step ``chosen`` (into each of ``world`` ranks)."""
        restore_file(self._path(chosen), chosen, state, self._config, rng_key=RNG_KEY, rng=self.rng,
                     strict=strict, rank_state=rank_state, world=world, drives=self._folders)

    @property
    def _folders(self) -> tuple[str, ...] | None:
        """The manager directory on each drive of its volume (None: a plain directory)."""
        return None if self._drives is None else self._drives.folders

    def _path(self, step: int) -> str:
        """Step ``step`` in the local directory, else in the durable tier (one process)."""
        here = step_dir(self.directory, step)
        return here if self._drainer is None or os.path.isdir(here) else step_dir(self._drainer.path, step)

    def _resolve(self, step: int | None) -> int:
        steps = self.steps()
        if step is None and steps:
            return steps[-1]
        if step is not None and step in steps:
            return step
        want = "no checkpoint" if step is None else f"no checkpoint of step {step}"
        raise FileNotFoundIOError(f"{want} in {self.directory!r} (committed steps: {steps})",
                                  path=self.directory, offset=None, size=None, errno=2)

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, mode={self.mode!r}, keep={self.keep}, "
                f"steps={list_steps(self.directory)})")  # no collective

