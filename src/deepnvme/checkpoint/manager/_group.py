"""The agreement group of a :class:`~deepnvme.CheckpointManager` spanning several ranks.

The manager never talks on the training group: it makes two gloo groups of the same ranks for
itself, one for the caller's thread (``save()``'s planning, ``restore``, ``steps``, ``close``)
and one for the background writer (each save's vote and commit), so the two threads never
interleave collectives on one group and every rank issues each group's collectives in the same
order (with ``durable=``, a third group for the durable tier's drain thread). Every exchange is
one ``all_gather`` of a fixed-size byte tensor holding each rank's pickled object (a second
``all_gather`` only when some object is larger than :data:`INLINE_BYTES`; ``all_gather_object``
would always run two, sizes then data). A rank that does not answer within the timeout fails the
exchange; the others then run a ``monitored_barrier`` (gloo reports which ranks did not arrive)
and raise :class:`RanksTimeoutError` naming it.
"""

from __future__ import annotations

import datetime
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ...errors import RanksTimeoutError

__all__ = ["INLINE_BYTES", "RankGroup", "RanksTimeoutError", "rank_group"]

_T = TypeVar("_T")

INLINE_BYTES = 4096 - 8  # an object pickled to at most this many bytes travels in the first all_gather


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
        """Every rank's ``obj``, by group rank (one ``all_gather`` when every pickle fits
        :data:`INLINE_BYTES`)."""
        group = self._groups[thread]
        return self._guarded(lambda: _all_gather(obj, self.world, group), thread, what)

    def collect(self, obj: Any, *, thread: str, what: str) -> list[Any] | None:
        """Every rank's ``obj`` on group rank 0 (by group rank), None on the others: one
        ``gather`` (a rank whose pickle does not fit also sends it to rank 0 on its own)."""
        group = self._groups[thread]
        return self._guarded(lambda: _gather_first(obj, self.rank, self.ranks, group), thread, what)

    def announce(self, obj: Any, *, thread: str, what: str) -> Any:
        """Group rank 0's ``obj`` on every rank (the others pass None): one ``broadcast``, two
        when the pickle does not fit."""
        group = self._groups[thread]
        return self._guarded(lambda: _broadcast_first(obj, self.rank, self.ranks[0], group), thread, what)

    def _guarded(self, exchange: Callable[[], _T], thread: str, what: str) -> _T:
        """Run ``exchange``; only when it fails (a rank missing past the timeout) does a
        ``monitored_barrier`` find out which ranks are missing, so a successful exchange costs
        its collectives and no barrier."""
        try:
            return exchange()
        except RuntimeError as failed:
            try:
                dist.monitored_barrier(group=self._groups[thread], wait_all_ranks=True,
                                       timeout=datetime.timedelta(seconds=self.timeout))
            except RuntimeError as exc:
                raise RanksTimeoutError(
                    f"deepnvme.CheckpointManager: {what}: not every rank of {self.ranks} arrived within "
                    f"{self.timeout:g} s (rank {dist.get_rank()} waited; gloo says: {exc}). Every rank "
                    "must call the manager's save/restore/steps/close in the same order") from failed
            raise RanksTimeoutError(
                f"deepnvme.CheckpointManager: {what}: the exchange between ranks {self.ranks} failed "
                f"(rank {dist.get_rank()}; gloo says: {failed}), though every rank answered a barrier "
                "afterwards: a rank arrived later than the timeout, or the group's connection broke") from failed

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


def _packed(obj: Any) -> tuple[bytes, torch.Tensor]:
    """``obj`` pickled, and the fixed-size head that carries it: an 8-byte length, then the
    pickle when it fits :data:`INLINE_BYTES`."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    head = torch.zeros(8 + INLINE_BYTES, dtype=torch.uint8)
    head[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    if len(data) <= INLINE_BYTES:
        head[8:8 + len(data)] = _bytes_tensor(data)
    return data, head


def _bytes_tensor(data: bytes, size: int | None = None) -> torch.Tensor:
    out = torch.zeros(len(data) if size is None else size, dtype=torch.uint8)
    out[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def _size(head: torch.Tensor) -> int:
    return int(head[:8].view(torch.int64))


def _unpacked(buf: torch.Tensor, offset: int, size: int) -> Any:
    return pickle.loads(buf[offset:offset + size].numpy().tobytes())


def _all_gather(obj: Any, world: int, group: Any) -> list[Any]:
    """Every rank's ``obj``: one ``all_gather`` of heads, and a second one, padded to the largest
    pickle, only when some rank's does not fit."""
    data, head = _packed(obj)
    heads = [torch.empty_like(head) for _ in range(world)]
    dist.all_gather(heads, head, group=group)
    sizes = [_size(h) for h in heads]
    if max(sizes) <= INLINE_BYTES:
        return [_unpacked(h, 8, n) for h, n in zip(heads, sizes)]
    body = _bytes_tensor(data, max(sizes))
    bodies = [torch.empty_like(body) for _ in range(world)]
    dist.all_gather(bodies, body, group=group)
    return [_unpacked(b, 0, n) for b, n in zip(bodies, sizes)]


def _gather_first(obj: Any, rank: int, ranks: list[int], group: Any) -> list[Any] | None:
    """Every rank's ``obj`` on group rank 0: one ``gather`` of heads; a rank whose pickle does
    not fit then sends it whole to rank 0, which knows its size from the head. ``ranks``: the
    group's global ranks (torch's ``dst``/``src`` are global ranks)."""
    data, head = _packed(obj)
    if rank != 0:
        dist.gather(head, None, dst=ranks[0], group=group)
        if len(data) > INLINE_BYTES:
            dist.send(_bytes_tensor(data), dst=ranks[0], group=group)
        return None
    heads = [torch.empty_like(head) for _ in ranks]
    dist.gather(head, heads, dst=ranks[0], group=group)
    out: list[Any] = []
    for r, h in enumerate(heads):
        n = _size(h)
        if n <= INLINE_BYTES:
            out.append(_unpacked(h, 8, n))
        elif r == 0:
            out.append(obj)
        else:
            body = torch.empty(n, dtype=torch.uint8)
            dist.recv(body, src=ranks[r], group=group)
            out.append(_unpacked(body, 0, n))
    return out


def _broadcast_first(obj: Any, rank: int, first: int, group: Any) -> Any:
    """Group rank 0's ``obj`` everywhere: one ``broadcast`` of its head, a second of the whole
    pickle when it does not fit."""
    data, head = _packed(obj if rank == 0 else None)
    dist.broadcast(head, src=first, group=group)
    if rank == 0:
        if len(data) > INLINE_BYTES:
            dist.broadcast(_bytes_tensor(data), src=first, group=group)
        return obj
    n = _size(head)
    if n <= INLINE_BYTES:
        return _unpacked(head, 8, n)
    body = torch.empty(n, dtype=torch.uint8)
    dist.broadcast(body, src=first, group=group)
    return _unpacked(body, 0, n)


def _new_group(ranks: list[int], timeout: datetime.timedelta) -> Any:
    """A gloo group of ``ranks``; every rank of the world calls it. (Not
    ``use_local_synchronization``: that names groups by their ranks alone, so the manager's two
    groups, or a later manager's, would share one rendezvous prefix.)"""
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout)
