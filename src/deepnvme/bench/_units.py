"""Units and summaries shared by every measurement: GB, min/median/max, binary sizes as text."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

__all__ = ["GB", "Stats", "fmt_size"]

GB = 1e9  # GB means 1e9 bytes everywhere in deepnvme


@dataclasses.dataclass(frozen=True)
class Stats:
    """min / median / max of a non-empty sequence of numbers."""

    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        if not values:
            raise ValueError("no values to summarise")
        return cls(min(values), statistics.median(values), max(values))

    def to_dict(self) -> dict[str, float]:
        return {"min": self.min, "median": self.median, "max": self.max}


def fmt_size(n: int) -> str:
    """``1073741824`` -> ``"1 GiB"``; exact binary multiples get a suffix, others stay bytes."""
    for shift, suffix in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {suffix}"
    return f"{n} B"
