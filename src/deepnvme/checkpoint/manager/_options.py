"""The staging options of :class:`~deepnvme.CheckpointManager`: ``staging=`` and the deprecated
mode keywords it replaced (``mode``, ``snapshot_arenas``, ``fence_staging_bytes``,
``fence_precopy``), mapped onto a :class:`~deepnvme.checkpoint.Stager`."""

from __future__ import annotations

from typing import Any

from ..._deprecation import warn_once
from .._staging import FencedStager, SnapshotStager, Stager, resolve_stager

__all__ = ["rank_staging", "resolve_manager_stager"]

_LEGACY_DEFAULTS: dict[str, Any] = {"mode": "snapshot", "snapshot_arenas": 1, "fence_staging_bytes": None,
                                    "fence_precopy": False}


def resolve_manager_stager(staging: str | Stager | None, legacy: dict[str, Any]) -> Stager:
    """The manager's stager from ``staging`` and the deprecated mode keywords (mapped, with a
    ``DeprecationWarning``); ``TypeError`` for an unknown keyword."""
    unknown = sorted(k for k in legacy if k not in _LEGACY_DEFAULTS)
    if unknown:
        raise TypeError(f"CheckpointManager() got unexpected keyword arguments {unknown}")
    if not legacy:
        return resolve_stager("snapshot" if staging is None else staging, "CheckpointManager")
    if staging is not None:
        raise ValueError(f"CheckpointManager: pass staging=... alone; {sorted(legacy)} are its "
                         "deprecated spellings")
    mode = legacy.get("mode", "snapshot")
    if mode not in ("snapshot", "fenced"):
        raise ValueError(f"CheckpointManager: mode must be 'snapshot' or 'fenced', got {mode!r}")
    wrong = [k for k, v in legacy.items() if k.startswith("fence_" if mode == "snapshot" else "snapshot_")
             and v != _LEGACY_DEFAULTS[k]]  # the other mode's options at their defaults are ignored
    if wrong:
        raise ValueError(f"CheckpointManager: {wrong} do not apply to mode={mode!r}")
    try:
        if mode == "snapshot":
            stager: Stager = SnapshotStager(arenas=legacy.get("snapshot_arenas", 1))
            new = f"staging=SnapshotStager(arenas={legacy.get('snapshot_arenas', 1)!r})"
        else:
            stager = FencedStager(staging_bytes=legacy.get("fence_staging_bytes"),
                                  precopy=legacy.get("fence_precopy", False))
            new = (f"staging=FencedStager(staging_bytes={legacy.get('fence_staging_bytes')!r}, "
                   f"precopy={legacy.get('fence_precopy', False)!r})")
    except ValueError as exc:
        raise ValueError(f"CheckpointManager({', '.join(f'{k}={v!r}' for k, v in legacy.items())}): "
                         f"{exc}") from None
    if list(legacy) == ["mode"]:
        new = f"staging={mode!r}"
    names = ", ".join(sorted(legacy))
    warn_once(f"CheckpointManager({names})", f"CheckpointManager({names}=...) is deprecated; pass {new} "
              "(from deepnvme.checkpoint)", stacklevel=3)
    return stager


def rank_staging(stager: Stager, world: int) -> tuple[int | None] | None:
    """How a manager over ``world`` ranks stages: None for snapshots of each rank's share,
    ``(staging_bytes,)`` for fenced saves of it (:mod:`._fenced_share`). ``ValueError`` for a
    stager the ranks cannot use."""
    if isinstance(stager, SnapshotStager):
        return None
    if isinstance(stager, FencedStager) and not stager.precopy:
        return (stager.staging_bytes,)
    what = "FencedStager(precopy=True)" if isinstance(stager, FencedStager) else f"staging={stager.name!r}"
    raise ValueError(f"CheckpointManager over {world} ranks: {what} is single-process only; use "
                     "staging='snapshot', 'fenced' or FencedStager(staging_bytes=...)")
