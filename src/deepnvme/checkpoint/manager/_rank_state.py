"""Per-rank state of :class:`~deepnvme.CheckpointManager`: ``save(..., rank_state=mapping)`` and
``restore(..., rank_state=mapping | "skip")``.

Each rank's mapping is kept apart from the shared state: in a multi-rank step it is one entry per
rank under :data:`~._steps.RANK_STATE_KEY` (``rank<r>``: the mapping as ``torch.save`` bytes, so
DCP stores it as one opaque item that only that rank writes and stock ``dcp.load`` skips); in a
single-process step it is the mapping itself under that key of ``state.pt``. A restore fills the
caller's mapping in place (``update``) when the world size is the one that saved it; at another
world size a saved per-rank state is an error naming its keys, unless ``rank_state="skip"``.
"""

from __future__ import annotations

import io
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import torch

from ...errors import CheckpointMismatchError

__all__ = ["check_save_arg", "check_restore_arg", "pack", "unpack", "fill", "refuse_other_world"]


def check_save_arg(rank_state: Any) -> dict[str, Any] | None:
    """``save``'s ``rank_state`` (None or a mapping with str keys) as a plain dict."""
    if rank_state is None:
        return None
    if not isinstance(rank_state, Mapping) or not all(isinstance(k, str) for k in rank_state):
        raise ValueError("CheckpointManager.save: rank_state must be a mapping with str keys, got "
                         f"{type(rank_state).__name__}")
    return dict(rank_state)


def check_restore_arg(rank_state: Any) -> None:
    """``restore``'s ``rank_state``: None, ``"skip"`` or a mutable mapping to fill."""
    if rank_state is None or rank_state == "skip" or isinstance(rank_state, MutableMapping):
        return
    raise ValueError('CheckpointManager.restore: rank_state must be a mutable mapping to fill, "skip" or None, '
                     f"got {rank_state!r}")


def pack(mapping: Mapping[str, Any]) -> bytes:
    """``mapping`` as ``torch.save`` bytes (read back by :func:`unpack`, ``weights_only``)."""
    buf = io.BytesIO()
    torch.save(dict(mapping), buf)
    return buf.getvalue()


def unpack(data: bytes) -> dict[str, Any]:
    """The mapping :func:`pack` stored."""
    loaded = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(loaded, dict):
        raise CheckpointMismatchError(f"the saved per-rank state is a {type(loaded).__name__}, not a mapping")
    return loaded


def fill(target: Any, loaded: Mapping[str, Any] | None) -> None:
    """Put a restored per-rank state into the caller's mapping (None or ``"skip"``: nothing)."""
    if loaded is not None and isinstance(target, MutableMapping):
        target.update(loaded)


def refuse_other_world(keys: Sequence[str] | None, *, saved_world: int, world: int, rank_state: Any,
                       what: str) -> bool:
    """Whether this restore reads the saved per-rank state (saved, same world size, not
    ``"skip"``). A per-rank state saved by ``saved_world`` ranks restored into another ``world`` is
    a :class:`CheckpointMismatchError` naming its ``keys``, unless ``rank_state="skip"``."""
    if keys is None or rank_state == "skip":
        return False
    if saved_world != world:
        raise CheckpointMismatchError(
            f"{what} holds a per-rank state (keys {sorted(keys)}) saved by {saved_world} rank(s); restoring "
            f"into {world} rank(s) cannot give each rank its own. Pass restore(..., rank_state=\"skip\") to "
            "restore without it", unexpected_keys=sorted(keys))
    return rank_state is not None
