"""The tiers of a multi-rank :class:`~deepnvme.CheckpointManager`, wired together: its nodes
(:mod:`._nodes`), replicas (:mod:`._replicas`), the durable drain (:mod:`._durable`) and the
listing and restore across them (:mod:`._tiers`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...config import IOConfig
from ._drives import StepDrives, same_volume
from ._durable import Drainer
from ._group import RankGroup
from ._node_folders import NodeFolders
from ._nodes import discover
from ._replicas import replicate
from ._tiers import Tiers

if TYPE_CHECKING:
    from ._ranks import RankSteps

__all__ = ["Tiering", "check_tier_options", "open_tiers"]


def check_tier_options(*, replicas: int, durable: str | None, durable_every: int,
                       keep_durable: int | None) -> None:
    """``ValueError`` naming the tier setting that is out of range."""
    if replicas not in (1, 2) or isinstance(replicas, bool):
        raise ValueError(f"CheckpointManager: replicas must be 1 or 2, got {replicas!r}")
    if isinstance(durable_every, bool) or not isinstance(durable_every, int) or durable_every < 1:
        raise ValueError(f"CheckpointManager: durable_every must be an int >= 1, got {durable_every!r}")
    if keep_durable is not None and (isinstance(keep_durable, bool) or not isinstance(keep_durable, int)
                                     or keep_durable < 1):
        raise ValueError(f"CheckpointManager: keep_durable must be an int >= 1 or None, got {keep_durable!r}")
    if durable is None and (durable_every != 1 or keep_durable is not None):
        raise ValueError("CheckpointManager: durable_every and keep_durable need durable=PATH")


class Tiering:
    """This rank's nodes and tiers. Construction is collective (the caller's thread): the ranks
    tell each other their host and directory. :meth:`after_commit` runs on the writer thread
    after each committed step (hands it to the drain, then replicates it, which raises on every
    rank when it failed); :meth:`close` finishes the drain (collective)."""

    def __init__(self, group: RankGroup, directory: str, *, keep: int | None, replicas: int,
                 durable: str | None, durable_every: int, keep_durable: int | None,
                 drives: StepDrives | None = None) -> None:
        self.group, self.directory, self.keep, self.replicas = group, directory, keep, replicas
        self.layout = discover(group, directory)
        same_volume(group, drives, self.layout.nodes)
        self.folders = NodeFolders(directory, drives)
        if replicas == 2:
            self.layout.check_replicas()
        self.drainer = None if durable is None else Drainer(durable, source=directory, every=durable_every,
                                                            keep=keep_durable, group=group, drives=drives)
        used = len(self.layout.nodes) > 1 or durable is not None
        self.tiers = Tiers(group, self.layout, directory, durable, replicas, drives=drives) if used else None
        self._tidied: set[int] = set()

    def after_commit(self, step: int) -> None:
        if self.drainer is not None:
            self.drainer.offer(step)
        if self.replicas == 2:
            replicate(self.group, self.layout, self.folders, step, self.keep, self._tidied)

    def close(self) -> None:
        if self.drainer is not None:
            self.drainer.close()


def open_tiers(ranks: RankGroup | None, directory: str, *, keep: int | None, config: IOConfig, rng_key: str,
               algorithm: str | None, replicas: int, durable: str | None, durable_every: int,
               keep_durable: int | None, fenced: tuple[int | None] | None = None,
               drives: StepDrives | None = None) -> tuple[RankSteps | None, Drainer | None]:
    """A manager's steps over several ranks (``ranks``) with their tiers, or, for one process
    (``ranks`` None), its durable drain (None without ``durable``). Collective with ranks.
    ``fenced``: ``(staging_bytes,)`` for fenced saves of each rank's share (None: snapshots).
    ``drives``: ``directory`` is drive 0's folder of a volume (this rank's node's)."""
    if ranks is None:
        if drives is not None:
            drives.check()
        if replicas != 1:
            raise ValueError("CheckpointManager(replicas=2) keeps copies on other nodes: it needs "
                             "torch.distributed ranks on at least two nodes")
        return None, None if durable is None else Drainer(durable, source=directory, every=durable_every,
                                                          keep=keep_durable, group=None, drives=drives)
    from ._fenced_share import ShareFences
    from ._ranks import RankSteps  # imports torch.distributed.checkpoint

    tiering = Tiering(ranks, directory, keep=keep, replicas=replicas, durable=durable,
                      durable_every=durable_every, keep_durable=keep_durable, drives=drives)
    return RankSteps(directory, ranks, keep=keep, config=config, rng_key=rng_key, algorithm=algorithm,
                     layout=tiering.layout, tiers=tiering.tiers, after_commit=tiering.after_commit,
                     closing=tiering.close,
                     fences=None if fenced is None else ShareFences(staging_bytes=fenced[0]), drives=drives), None
