"""The reading half of the multi-rank manager (:class:`~._ranks.RankSteps`): the committed steps as
every rank sees them, and a restore that checks a step's files together and reads it with DCP
(falling back to an older step when ``step=None`` and one is corrupt)."""

from __future__ import annotations

import errno as errno_mod
import logging
from collections.abc import Callable, MutableMapping
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata

from ...config import IOConfig
from ...errors import CheckpointCorruptError, FileNotFoundIOError
from ._dcp_restore import files_to_check, plan_reads, restore_dcp
from ._dcp_step import ReadHints
from ._drives import StepDrives
from ._group import RankGroup
from ._steps import is_dcp_step, list_steps, read_manifest, step_dir
from ._tiers import Source, Tiers
from ._verify import check_step_files
from ._votes import describe as _describe
from ._votes import failed as _failed

__all__ = ["RankReads"]

log = logging.getLogger(__name__)


def _kept(restored: bool) -> None:
    """Nothing to do after reading a step in place."""


class RankReads:
    """``steps`` and ``restore`` of :class:`~._ranks.RankSteps` (a base class: the attributes
    below are set by it)."""

    directory: str
    group: RankGroup
    config: IOConfig
    rng_key: str
    drives: StepDrives | None
    tiers: Tiers | None

    def steps(self) -> list[int]:
        """Collective: the committed steps as rank 0 sees them (with tiers: the steps some
        tier holds whole, :mod:`._tiers`)."""
        if self.tiers is not None:
            return self.tiers.survey().steps()
        mine = list_steps(self.directory) if self.group.rank == 0 else None
        steps: list[int] = self.group.gather(mine, thread="main", what="steps()")[0]
        return steps

    def restore(self, state: MutableMapping[str, Any], step: int | None, *, rng: bool, strict: bool,
                single: Callable[[int], None], rank_state: Any = None) -> int:
        """Collective: load ``step`` (None: the newest that verifies, as rank 0 lists them) into
        ``state``; ``rank_state`` as in :func:`restore_dcp`. The ranks check a step's files
        together first (:meth:`_check`): a corrupt ``step`` raises
        :class:`CheckpointCorruptError` on every rank; with ``step=None`` a corrupt step is logged
        and the next older one tried, on every rank alike. ``single(step)`` restores a step saved
        by one process (each rank reads all of it and checks its checksums as it reads)."""
        g = self.group
        survey = None if self.tiers is None else self.tiers.survey()
        steps: list[int] = survey.steps() if survey is not None else g.gather(
            list_steps(self.directory) if g.rank == 0 else None, thread="main", what="restore()")[0]
        candidates = steps[::-1] if step is None else [step] if step in steps else []
        if not candidates:
            want = "no checkpoint" if step is None else f"no checkpoint of step {step}"
            hint = "" if survey is None else survey.explain(step)  # a step that some node lacks
            raise FileNotFoundIOError(f"{want} in {self.directory!r} (committed steps: {steps}){hint}",
                                      path=self.directory, offset=None, size=None, errno=errno_mod.ENOENT)
        problems = []
        for chosen in candidates:
            problem: str | None = f"checkpoint step {chosen}: no tier holds it"

            def reads(metadata: Metadata, local: dict[str, frozenset[int]], at: int = chosen
                      ) -> list[list[tuple[str, int, int]]] | None:
                return plan_reads(state, metadata, rank=g.rank, strict=strict, rng_key=self.rng_key, local=local,
                                  gather=lambda obj: g.gather(obj, thread="main", what=f"restore(step={at}) plan"))

            sources = self.tiers.sources(survey, chosen, reads) if survey is not None and self.tiers is not None \
                else iter([Source(step_dir(self.directory, chosen), _kept)])
            for source in sources:  # with tiers: the fastest first, then the durable one
                path, restored = source.path, False
                try:
                    problem = self._check(path, chosen)
                    if problem is None and not is_dcp_step(path):
                        single(chosen)
                        restored = True
                        return chosen
                    if problem is None:
                        problem = self._read(path, chosen, state, rng=rng, strict=strict, rank_state=rank_state,
                                             hints=source.hints)
                        if problem is None:
                            restored = True
                            return chosen
                finally:
                    source.done(restored)
            if step is not None:
                raise CheckpointCorruptError(problem)
            log.warning("deepnvme.CheckpointManager.restore: skipping %s; trying the previous step", problem)
            problems.append(str(problem))
        raise CheckpointCorruptError(f"no intact checkpoint in {self.directory!r}: {'; '.join(problems)}")

    def _read(self, path: str, step: int, state: MutableMapping[str, Any], *, rng: bool, strict: bool,
              rank_state: Any, hints: ReadHints | None = None) -> str | None:
        """Collective: restore the multi-rank step at ``path``; what is corrupt in it on any rank
        (items are checked as read; None: restored). Other failures raise on every rank."""
        g = self.group
        own: BaseException | None = None
        try:
            restore_dcp(path, step, state, group=g.group("main"), rank=g.rank, world=g.world,
                        rng_key=self.rng_key if rng else None, config=self.config, strict=strict,
                        rank_state=rank_state, hints=hints, drives=self.drives)
        except BaseException as exc:  # heard by every rank below, so that all act alike
            own = exc
        said = g.gather(_describe(own), thread="main", what=f"restore(step={step}) read")
        if corrupt := [v[1] for v in said if v is not None and v[0] == CheckpointCorruptError.__name__]:
            return "; ".join(dict.fromkeys(corrupt))  # each names the step, and the file and item
        if any(v is not None for v in said):
            if own is not None:
                raise own
            raise _failed(f"restore of checkpoint step {step} in {self.directory!r}", said, own)
        return None

    def _check(self, path: str, step: int) -> str | None:
        """Collective: what is wrong with the multi-rank step at ``path`` (None: intact). Each
        rank checks every W-th of the manifest's files (sizes, and checksums when stored) and the
        ranks exchange their findings, so all reach the same verdict having read each file once.
        A single-process step is checked as it is read."""
        g = self.group
        found: str | None = None
        if is_dcp_step(path):
            try:
                manifest = read_manifest(path, step)
                wrong = check_step_files(path, files_to_check(manifest, g.world),
                                         sorted(manifest.get("files", {}))[g.rank::g.world],
                                         drives=None if self.drives is None else self.drives.beside(path))
                found = "; ".join(wrong) or None
            except CheckpointCorruptError as exc:
                found = str(exc)
        verdicts = g.gather(found, thread="main", what=f"restore(step={step}) check")
        bad = [f"rank {r}: {v}" for r, v in enumerate(verdicts) if v is not None]
        return f"checkpoint step {step} in {self.directory!r} is corrupt ({'; '.join(bad)})" if bad else None
