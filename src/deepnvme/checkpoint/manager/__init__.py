"""``deepnvme.CheckpointManager`` and its parts: the steps' layout (:mod:`._steps`), the writer's
lock (:mod:`._lock`), the interval and retention rules (:mod:`._policy`), the step commit
(:mod:`._commit`), restore (:mod:`._restore`, :mod:`._verify`), checksums and RNG states."""

from ._manager import RNG_KEY, CheckpointManager, SaveStats

__all__ = ["CheckpointManager", "RNG_KEY", "SaveStats"]
