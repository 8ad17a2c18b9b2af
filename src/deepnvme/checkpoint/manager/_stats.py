"""What a :class:`~deepnvme.CheckpointManager`'s saves cost the training thread."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SaveStats"]


@dataclass(frozen=True)
class SaveStats:
    """What this manager's saves cost the training thread so far (seconds, cumulative)."""

    saves: int
    blocked_seconds: float  # inside save() plus fenced optimizer steps waiting
    fence_wait_seconds: float  # the fenced optimizer steps' part of blocked_seconds
    arena_wait_seconds: float  # snapshot: save() waiting for the previous write to free the arena
    last_write_seconds: float  # background: the newest finished save's write + fsync
    fence_copied_bytes: int = 0  # fenced: bytes the optimizer step pre-hooks copied into staging
    fence_precopied_bytes: int = 0  # fenced with precopy: bytes copied in the background
