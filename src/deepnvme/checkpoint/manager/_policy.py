"""Pure rules of :class:`~deepnvme.CheckpointManager`: when a step is due, which steps retention removes."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["check_policy", "is_due", "retention_victims"]


def check_policy(*, keep: int | None, every_steps: int | None, every_seconds: float | None) -> None:
    """Raise ``ValueError`` naming the setting when one of the manager's policy options is out of range."""
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"CheckpointManager: keep must be an int >= 1 (or None to keep all), got {keep!r}")
    if every_steps is not None and (not isinstance(every_steps, int) or every_steps < 1):
        raise ValueError(f"CheckpointManager: every_steps must be an int >= 1 or None, got {every_steps!r}")
    if every_seconds is not None and not every_seconds > 0:
        raise ValueError(f"CheckpointManager: every_seconds must be > 0 or None, got {every_seconds!r}")


def is_due(step: int, *, first: bool, every_steps: int | None, every_seconds: float | None,
           seconds_since_last: float) -> bool:
    """Whether ``step`` should be saved (orbax's rule).

    ``first``: nothing was ever saved in the directory (always due). ``every_steps=N``: due when
    ``step % N == 0``; ``every_seconds=T``: due when ``seconds_since_last >= T`` (time since the
    last save started, or since the manager opened); both set: either one; neither: every step.
    """
    if first or (every_steps is None and every_seconds is None):
        return True
    by_steps = every_steps is not None and step % every_steps == 0
    by_time = every_seconds is not None and seconds_since_last >= every_seconds
    return by_steps or by_time


def retention_victims(steps: Sequence[int], keep: int | None) -> list[int]:
    """The committed steps to delete so that the newest ``keep`` remain (oldest first).

    ``keep=None`` keeps everything; the newest step is never a victim (``keep >= 1``).
    """
    ordered = sorted(steps)
    if keep is None or len(ordered) <= keep:
        return []
    return ordered[:len(ordered) - max(keep, 1)]
