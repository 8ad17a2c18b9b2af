"""Restoring a multi-rank step (a DCP checkpoint, :mod:`._dcp_step`) into one rank's state: the
shared state (DCP reshards where the world size differs), then this rank's own entries (RNG
states, per-rank state) where the world size is the one that saved them."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from ...config import IOConfig
from ...errors import CheckpointCorruptError
from ..dcp import NVMeStorageReader
from ._dcp_step import load_into, read_step, rng_entry, state_dicts
from ._rank_state import fill, refuse_other_world, unpack
from ._rng import capture_rng, restore_rng
from ._steps import RANK_STATE_KEY, read_manifest
from ._verify import check_step_files

__all__ = ["restore_dcp", "rank_state_keys"]

log = logging.getLogger(__name__)


def rank_state_keys(manifest: dict[str, Any]) -> list[str] | None:
    """The keys of the per-rank states a multi-rank step holds (all ranks'), None: none saved."""
    saved: dict[str, list[str]] | None = manifest.get("rank_state")
    return None if not saved else sorted({k for keys in saved.values() for k in keys})


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
    if verify and (wrong := check_step_files(path, manifest)):
        raise CheckpointCorruptError(f"checkpoint step {step}: {'; '.join(wrong)}")
    saved = state_dicts(state)
    read_step(path, saved, group=group, config=config, partial=not strict)
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
    read_step(path, holder, group=None, config=config)
    if own_state:
        fill(rank_state, unpack(holder[RANK_STATE_KEY][rng_entry(rank)]))
    if rng_key is not None and rng_key in holder:
        restore_rng(holder[rng_key][rng_entry(rank)])
