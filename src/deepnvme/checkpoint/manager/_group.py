"""The agreement group of a :class:`~deepnvme.CheckpointManager` spanning several ranks.

The manager never talks on the training group: it makes two gloo groups of the same ranks for
itself, one for the caller's thread (``save()``'s planning, ``restore``, ``steps``, ``close``)
and one for the background writer (each save's vote and commit), so the two threads never
interleave collectives on one group and every rank issues each group's collectives in the same
order (with ``durable=``, a third group for the durable tier's drain thread). Every exchange is
a ``monitored_barrier`` (gloo reports which ranks did not arrive within the timeout) followed by
``all_gather_object``; a rank that does not answer in time makes the others raise
:class:`RanksTimeoutError` naming it.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from ...errors import RanksTimeoutError

__all__ = ["RankGroup", "RanksTimeoutError", "rank_group"]


class RankGroup:
    """This rank's place in the manager's ranks and its two gloo groups (``thread``: ``"main"``
    for the caller's thread, ``"writer"`` for the background writer). Not thread-safe per
    thread name: each name is used by one thread only."""

    def __init__(self, ranks: list[int], timeout: float, names: tuple[str, ...] = ("main", "writer")) -> None:
        self.ranks = ranks  # global ranks, ascending; group rank i is ranks[i]
        self.timeout = timeout
        td = datetime.timedelta(seconds=timeout)
        self._groups = {name: _new_group(ranks, td) for name in names}
        self.rank = ranks.index(dist.get_rank())
        self.world = len(ranks)

    def gather(self, obj: Any, *, thread: str, what: str) -> list[Any]:
        """Every rank's ``obj``, by group rank; :class:`RanksTimeoutError` naming the ranks that
        did not arrive within the timeout."""
        group = self._groups[thread]
        try:
            dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=self.timeout),
                                   wait_all_ranks=True)
        except RuntimeError as exc:
            raise RanksTimeoutError(
                f"deepnvme.CheckpointManager: {what}: not every rank of {self.ranks} arrived within "
                f"{self.timeout:g} s (rank {dist.get_rank()} waited; gloo says: {exc}). Every rank "
                "must call the manager's save/restore/steps/close in the same order") from exc
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=group)
        return out

    def group(self, thread: str) -> Any:
        """The process group of ``thread`` (for DCP's own collectives on that thread)."""
        return self._groups[thread]

    def close(self) -> None:
        """Destroy the two groups (local for gloo; idempotent)."""
        for name, group in list(self._groups.items()):
            dist.destroy_process_group(group)
            del self._groups[name]


def rank_group(group: Any, timeout: float, *, extra: tuple[str, ...] = ()) -> RankGroup | None:
    """The manager's :class:`RankGroup` over ``group`` (None: the world), or None when
    torch.distributed is not initialised or the group has one rank (single-process mode).
    Collective over the whole world (``torch.distributed.new_group``'s rule) unless it returns
    None; a rank outside ``group`` takes part, then gets ``ValueError``. ``extra``: names of
    further groups, one per further thread (the durable tier's drain: ``"durable"``)."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError("CheckpointManager(group=...): torch.distributed is not initialised")
        return None
    ranks = sorted(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if len(ranks) == 1:
        return None
    if timeout <= 0:
        raise ValueError(f"CheckpointManager: timeout must be > 0 seconds, got {timeout!r}")
    if dist.get_rank() not in ranks:
        for _ in range(2 + len(extra)):  # new_group is a collective of the whole world: take part, then refuse
            _new_group(ranks, datetime.timedelta(seconds=timeout))
        raise ValueError(f"CheckpointManager(group=...): rank {dist.get_rank()} is not in the group {ranks}")
    return RankGroup(ranks, timeout, ("main", "writer", *extra))


def _new_group(ranks: list[int], timeout: datetime.timedelta) -> Any:
    """A gloo group of ``ranks``; every rank of the world calls it. (Not
    ``use_local_synchronization``: that names groups by their ranks alone, so the manager's two
    groups, or a later manager's, would share one rendezvous prefix.)"""
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
