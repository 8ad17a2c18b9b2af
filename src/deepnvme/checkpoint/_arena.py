"""The one pool of staging arenas of asynchronous saves: page-locked host buffers reused across saves.

Both stagers draw from it (:mod:`._staging`): a snapshot copies a save's tensors into an arena,
a fenced save copies the tensors an optimizer step is about to change. An arena is a 1-D uint8
tensor from :func:`deepnvme.memory.pinned.new_cpu_locked_tensor` (page-aligned, locked when the
limits allow); a slot keeps its arena between saves and replaces it only when a save needs more.

Memory bound: ``count`` arenas, each as large as the largest request made of it so far.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import torch

from ..io.plan import align_up
from ..memory.pinned import free_cpu_locked_tensor, new_cpu_locked_tensor

__all__ = ["ALIGN", "ArenaPool", "Lease", "arena_bytes"]

ALIGN = 4096  # every storage starts on a page in an arena (O_DIRECT needs aligned sources)


def arena_bytes(sizes: Iterable[int]) -> int:
    """The arena bytes that storages of ``sizes`` bytes need, each slot rounded up to 4096."""
    return sum(align_up(size, ALIGN) for size in sizes)


class Lease:
    """One arena taken from an :class:`ArenaPool`; :meth:`release` gives it back (once)."""

    def __init__(self, pool: ArenaPool, index: int, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._pool = pool
        self._index: int | None = index

    def grow(self, nbytes: int, *, keep: int) -> torch.Tensor:
        """Replace the arena with one of at least ``nbytes`` bytes holding its first ``keep``
        bytes (a no-op when it is large enough already); the new arena."""
        if self._index is None:
            raise RuntimeError("grow() of an arena already given back")
        if self.tensor.numel() < nbytes:
            old, self.tensor = self.tensor, new_cpu_locked_tensor(nbytes, torch.uint8)
            self.tensor[:keep].copy_(old[:keep])
            self._pool._replace(self._index, self.tensor)
            free_cpu_locked_tensor(old)
        return self.tensor

    def release(self) -> None:
        """Give the arena back to the pool (idempotent)."""
        index, self._index = self._index, None
        if index is not None:
            self._pool._give(index)


class ArenaPool:
    """``count`` reusable locked arenas. Thread-safe; :meth:`take` blocks while all are leased."""

    def __init__(self, count: int, *, what: str = "arenas") -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"{what} must be an int >= 1, got {count!r}")
        self._arenas: list[torch.Tensor | None] = [None] * count
        self._free = [True] * count
        self._cond = threading.Condition()
        self._closed = False
        self.wait_seconds = 0.0  # time callers of take() spent waiting for a free arena

    @property
    def count(self) -> int:
        return len(self._arenas)

    def busy(self) -> bool:
        """True when every arena is leased (a :meth:`take` now would wait)."""
        with self._cond:
            return not any(self._free)

    def take(self, nbytes: int) -> Lease:
        """An arena of at least ``nbytes`` bytes (an allocated one first), waiting until one is
        free. An arena too small is freed and replaced; if that allocation fails the slot is
        left empty (never a freed arena) and the error is raised."""
        start = time.perf_counter()
        with self._cond:
            while not any(self._free) and not self._closed:
                self._cond.wait()
            if self._closed:
                raise RuntimeError("the staging arena pool is closed")
            free = [i for i, ok in enumerate(self._free) if ok]
            index = next((i for i in free if self._arenas[i] is not None), free[0])
            self._free[index] = False
        self.wait_seconds += time.perf_counter() - start
        try:
            arena = self._arenas[index]
            if arena is None or arena.numel() < nbytes:
                self._arenas[index] = None
                if arena is not None:  # outgrown: a new, larger arena
                    free_cpu_locked_tensor(arena)
                arena = self._arenas[index] = new_cpu_locked_tensor(max(nbytes, 1), torch.uint8)
        except BaseException:
            self._give(index)
            raise
        return Lease(self, index, arena)

    def arenas(self) -> list[torch.Tensor | None]:
        """The slots' arenas (None: not allocated), for inspection."""
        with self._cond:
            return list(self._arenas)

    def _replace(self, index: int, arena: torch.Tensor) -> None:
        with self._cond:
            self._arenas[index] = arena

    def _give(self, index: int) -> None:
        with self._cond:
            self._free[index] = True
            arena = self._arenas[index]
            if self._closed and arena is not None:  # given back after close(): free it now
                free_cpu_locked_tensor(arena)
                self._arenas[index] = None
            self._cond.notify_all()

    def close(self) -> None:
        """Free the arenas (a leased one when it is given back); later :meth:`take` calls fail."""
        with self._cond:
            self._closed = True
            for i, arena in enumerate(self._arenas):
                if arena is not None and self._free[i]:
                    free_cpu_locked_tensor(arena)
                    self._arenas[i] = None
            self._cond.notify_all()
