"""Pure search over a handle-settings grid for ``deepnvme tune`` (no I/O here).

:func:`coordinate_search` walks one dimension at a time from a start point: it moves up the
dimension's ordered values while the score improves by more than ``tolerance``, otherwise down,
and stops the dimension after ``patience + 1`` steps in a row that do not help (so one noisy
measurement does not end a dimension). Passes repeat until a pass
changes nothing (at most ``max_passes``). ``score`` returns None to stop the whole search
(the time budget ran out).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence

__all__ = ["Value", "Point", "make_point", "coordinate_search", "grid", "closest"]

Value = int | str  # a number (sizes, counts, booleans) or a category (an engine name)
Point = tuple[tuple[str, Value], ...]  # ((name, value), ...) in dimension order; hashable


def make_point(values: Mapping[str, Value], order: Sequence[str]) -> Point:
    return tuple((name, values[name]) for name in order)


def closest(values: Sequence[int], target: int) -> int:
    """The value nearest to ``target`` by ratio (sizes and counts are compared in log scale)."""
    return min(values, key=lambda v: (max(v, target) / max(min(v, target), 1), v))


def grid(dims: Mapping[str, Sequence[Value]]) -> list[Point]:
    """Every combination, in dimension order."""
    names = list(dims)
    return [tuple(zip(names, combo)) for combo in itertools.product(*(dims[n] for n in names))]


def coordinate_search(dims: Mapping[str, Sequence[Value]], start: Mapping[str, Value],
                      score: Callable[[Point], float | None], *, tolerance: float = 0.03,
                      patience: int = 1, max_passes: int = 2) -> Point | None:
    """Best point found (or None if nothing could be scored). ``dims`` values are in search
    order: numbers ascending, categories (engine names) in order of preference."""
    order = list(dims)
    current = dict(start)
    best = score(make_point(current, order))
    if best is None:
        return None
    for _ in range(max_passes):
        changed = False
        for name in order:
            values = list(dims[name])
            if len(values) < 2:
                continue
            i0 = values.index(current[name])
            moved = False
            for step in (1, -1):
                if moved:
                    break
                i, misses = i0 + step, 0
                while 0 <= i < len(values) and misses <= patience:
                    cand = {**current, name: values[i]}
                    s = score(make_point(cand, order))
                    if s is None:
                        return make_point(current, order)
                    if s > best * (1 + tolerance):
                        best, current, moved, changed, misses = s, cand, True, True, 0
                    else:
                        misses += 1
                    i += step
        if not changed:
            break
    return make_point(current, order)
