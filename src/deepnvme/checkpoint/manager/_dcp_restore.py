"""Restoring a multi-rank step (a DCP checkpoint, :mod:`._dcp_step`) into one rank's state: the
shared state (DCP reshards where the world size differs), then this rank's own entries (RNG
states, per-rank state) where the world size is the one that saved them."""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from typing import Any

from ...config import IOConfig
from ...errors import CheckpointCorruptError
from ..dcp import NVMeStorageReader
from ..dcp._sums import ItemSums
from ._dcp_step import item_sums, load_into, read_step, rng_entry, state_dicts
from ._rank_state import fill, refuse_other_world, unpack
from ._rng import capture_rng, restore_rng
from ._steps import RANK_STATE_KEY, read_manifest
from ._verify import check_step_files

__all__ = ["restore_dcp", "rank_state_keys", "files_to_check"]

log = logging.getLogger(__name__)


def rank_state_keys(manifest: dict[str, Any]) -> list[str] | None:
    """The keys of the per-rank states a multi-rank step holds (all ranks'), None: none saved."""
    saved: dict[str, list[str]] | None = manifest.get("rank_state")
    return None if not saved else sorted({k for keys in saved.values() for k in keys})


def files_to_check(manifest: dict[str, Any], world: int) -> dict[str, Any]:
    """The manifest to check a step's files against before reading it into ``world`` ranks:
    without the data files' whole-file checksums (sizes only; ``.metadata``'s kept) where every
    item is checked as it is read (per-item checksums stored, the saving world size: each item
    is read whole), so the data is read once; the manifest itself otherwise."""
    if manifest.get("tensor_checksums") is None or int(manifest.get("world_size", 0)) != world:
        return manifest
    sums = manifest.get("file_checksums") or {}
    return {**manifest, "file_checksums": {k: v for k, v in sums.items() if k == ".metadata"}}


def _read(path: str, step: int, saved: dict[str, Any], *, group: Any, config: IOConfig, partial: bool = False,
          sums: ItemSums | None) -> None:
    """:func:`read_step`, a failed item checksum named with the step."""
    try:
        read_step(path, saved, group=group, config=config, partial=partial, sums=sums)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"checkpoint step {step} in {os.path.dirname(path)!r} is corrupt: "
                                     f"{exc}") from exc


def restore_dcp(path: str, step: int, state: MutableMapping[str, Any], *, group: Any, rank: int, world: int,
                rng_key: str | None, config: IOConfig, strict: bool, rank_state: Any = None,
                verify: bool = False) -> None:
    """Load the multi-rank step at ``path`` into ``state`` (DCP reshards when ``world`` differs
    from the saving world), then this rank's RNG states when ``rng_key`` is given and the world
    size is unchanged (otherwise they are left alone, with a warning) and its per-rank state into
    ``rank_state`` (see :mod:`._rank_state`; checked before anything is read). ``verify``: check
    every file's size and stored checksum first (one process reading a step alone)."""
    manifest = read_manifest(path, step)
    saved_world = int(manifest.get("world_size", 0))
    own_state = refuse_other_world(rank_state_keys(manifest), saved_world=saved_world, world=world,
                                   rank_state=rank_state, what=f"checkpoint step {step}")
    if verify and (wrong := check_step_files(path, files_to_check(manifest, world))):
        raise CheckpointCorruptError(f"checkpoint step {step}: {'; '.join(wrong)}")
    sums = item_sums(manifest)
    saved = state_dicts(state)
    _read(path, step, saved, group=group, config=config, partial=not strict, sums=sums)
    load_into(state, saved, strict=strict)
    holder: dict[str, Any] = {}
    own_state = own_state and rng_entry(rank) in (manifest.get("rank_state") or {})
    if own_state:
        holder[RANK_STATE_KEY] = {rng_entry(rank): b""}
    if rng_key is not None and saved_world != world:
        log.warning("deepnvme.CheckpointManager: step %d was saved by %s ranks, restored by %d: RNG "
                    "states are left as they are", step, manifest.get("world_size"), world)
    elif rng_key is not None:
        stored = NVMeStorageReader(path, config=config).read_metadata().state_dict_metadata
        if any(key.startswith(f"{rng_key}.{rng_entry(rank)}.") for key in stored):  # else rng=False
            holder[rng_key] = {rng_entry(rank): capture_rng()}
    if not holder:
        return
    _read(path, step, holder, group=None, config=config, sums=sums)
    if own_state:
        fill(rank_state, unpack(holder[RANK_STATE_KEY][rng_entry(rank)]))
    if rng_key is not None and rng_key in holder:
        restore_rng(holder[rng_key][rng_entry(rank)])
