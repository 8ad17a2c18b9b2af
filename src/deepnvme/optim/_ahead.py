"""Which sub-groups' state an update fused into the backward reads ahead, and when.

The fused update (:mod:`._fused`) installs a sub-group's state when its last gradient arrives;
a read started only then makes the backward wait for it. Reads are started earlier from:

- the offload's notice (:meth:`ReadsAhead.notice`): an FSDP2 group was all-gathered for the
  backward, so its shards' gradients come after that group's backward compute;
- the order the previous step updated its sub-groups in: after each update, the next ones of
  that order not yet updated (a model's gradients arrive in the same order every step, which
  need not be the sub-groups' reverse order: FSDP2 hands a group's weight before its bias);
- with no order learned yet, the sub-group before the one just updated (the usual reverse
  order of a backward), as before.

Memory: pool buffers of the swapper only. Reads ahead plus the buffers kept by failed writes
never hold every buffer, so an install always gets one (at worst after an in-flight write); an
install that would find none lets reads ahead go first (:meth:`ReadsAhead.installing`). A write
in flight may still fail and keep its buffer: an install that needs that buffer waits for the
write first, then counts again.
A read ahead started from a notice or the learned order takes only a buffer free at that
moment: it never blocks the backward. Not thread-safe: the backward's thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from ._state import StateSwap

__all__ = ["ReadsAhead"]


class ReadsAhead:
    """The reads ahead of one fused update (see the module doc); ``kept()`` counts the
    buffers held by this step's failed writes, ``writing()`` lists its writes in flight."""

    def __init__(self, state: StateSwap, kept: Callable[[], int],
                 writing: Callable[[], list[Future[None]]] | None = None) -> None:
        self.state = state
        self.kept = kept
        self.writing = writing or list
        self.ahead: set[int] = set()          # sub-groups read ahead, not yet installed
        self.done: set[int] = set()           # sub-groups updated in this step
        self.order: list[int] = []            # this step's updates, in order
        self.learned: list[int] = []          # the previous step's order
        self.where: dict[int, int] = {}       # sub-group -> its place in ``learned``

    def notice(self, i: int) -> None:
        """Sub-group ``i``'s gradients come soon: read its state if a buffer is free now."""
        if i not in self.done:
            self.start(i, wait=False)

    def installing(self, i: int) -> bool:
        """Sub-group ``i``'s state is installed next: it leaves ``ahead``; if it was not read
        ahead and reads ahead (with failed writes) hold every buffer, some are let go. True if
        it was read ahead (its buffer is held already)."""
        swapper = self.state.swapper
        while i not in self.ahead and self.ahead:
            if len(self.ahead) + self.kept() >= swapper.buffer_count:
                swapper.release(self.ahead.pop())
                continue
            pending = self.writing()
            if swapper.buffers_in_use() < swapper.buffer_count or not pending:
                break   # a buffer is free, or one comes back from a write that ended
            # every buffer is held: the install would wait for a write's buffer, which a
            # failing write keeps; wait for one here and count again
            wait(pending, return_when=FIRST_COMPLETED)
        if i in self.ahead:
            self.ahead.discard(i)
            return True
        return False

    def updated(self, subs: list[int]) -> None:
        """Sub-groups ``subs`` were updated: start reading the ones expected next."""
        self.done.update(subs)
        self.order.extend(subs)
        place = self.where.get(subs[-1])
        if place is None:
            if subs[0] > 0 and subs[0] - 1 not in self.done:
                self.start(subs[0] - 1, wait=True)   # the backward goes on with the previous one
            return
        for j in self.learned[place + 1:place + 1 + self.state.swapper.buffer_count]:
            if j not in self.done and not self.start(j, wait=False) and j not in self.ahead:
                return   # no buffer now: the later ones wait for the next update or notice

    def start(self, i: int, *, wait: bool, reserve: int = 0) -> bool:
        """Start reading sub-group ``i``'s state unless it is read already, or that would leave
        no buffer for an install (and ``reserve`` more: installs about to take one);
        ``wait=False``: only into a buffer free now. True if read."""
        state, swapper = self.state, self.state.swapper
        if i in self.ahead or state.subs.layouts[i] is None:
            return False
        if len(self.ahead) + self.kept() + 1 + reserve >= swapper.buffer_count:
            return False
        if not wait and swapper.buffers_in_use() >= swapper.buffer_count:
            return False
        self.ahead.add(i)
        state.prefetch(i)
        return True

    def end_step(self, *, completed: bool) -> None:
        """The step ended (its buffers are released by the caller): a completed step's order
        is learned for the next."""
        if completed and self.order:
            self.learned = self.order
            self.where = {i: k for k, i in enumerate(self.learned)}
        self.order = []
        self.ahead.clear()
        self.done.clear()
