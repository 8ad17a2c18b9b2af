"""Learning the order in which modules need their parameters, to prefetch the next ones.

Pure bookkeeping over integers (module indices): a pass (a forward, or a backward) is recorded
as the sequence of distinct consecutive visits; the recorded sequence of the last pass that
differed from the learned one becomes the learned order at the start of the next pass. While
the current pass follows the learned order, each visit names the next ``depth`` modules.
"""

from __future__ import annotations

__all__ = ["OrderTracker"]


class OrderTracker:
    """Learns one pass's visiting order; :meth:`visit` returns the modules expected next.

    Memory bound: two lists of at most the number of visits in one pass.
    """

    def __init__(self, depth: int) -> None:
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self.depth = depth
        self.learned: list[int] | None = None
        self._current: list[int] = []
        self._on_track = True
        self.relearned = 0   # how many times the order changed after the first pass

    def start(self) -> None:
        """A new pass begins: the one just recorded becomes the learned order if it differs."""
        if self._current and self._current != self.learned:
            if self.learned is not None:
                self.relearned += 1
            self.learned = self._current
        self._current = []
        self._on_track = True

    def visit(self, unit: int) -> list[int]:
        """Record a visit of ``unit``; return the units the learned order expects next (none
        once this pass left the learned order, or when revisiting the same unit)."""
        if self._current and self._current[-1] == unit:
            return []
        self._current.append(unit)
        learned, n = self.learned, len(self._current)
        if learned is None or not self._on_track or n > len(learned) or learned[n - 1] != unit:
            self._on_track = False
            return []
        return learned[n:n + self.depth]
