"""Restoring a multi-rank step (a DCP checkpoint, :mod:`._dcp_step`) into one rank's state: the
shared state (DCP reshards where the world size differs), then this rank's own entries (RNG
states, per-rank state) where the world size is the one that saved them."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, MutableMapping
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan

from ...config import IOConfig
from ...errors import CheckpointCorruptError
from ..dcp import NVMeStorageReader
from ..dcp._share import Schedule, key_of, schedule
from ..dcp._sums import ItemSums
from ._dcp_step import ReadHints, item_sums, load_into, read_step, rng_entry, state_dicts
from ._drives import StepDrives
from ._rank_state import fill, refuse_other_world, unpack
from ._rng import capture_rng, restore_rng
from ._steps import RANK_STATE_KEY, read_manifest
from ._verify import check_step_files

__all__ = ["restore_dcp", "rank_state_keys", "files_to_check", "plan_reads"]

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


def plan_reads(state: MutableMapping[str, Any], metadata: Metadata, *, gather: Callable[[Any], list[Any]],
               rank: int, strict: bool, rng_key: str, local: dict[str, frozenset[int]]
               ) -> list[list[tuple[str, int, int]]] | None:
    """Collective (``gather``: every rank's object, by rank): the ``(data file, offset, length)``
    of the items each rank will read from storage when :func:`restore_dcp` loads ``state`` from a
    step with ``metadata`` at its saving world size: its own requests, the shared ones the
    schedule gives it (to a rank whose node holds the file, per ``local``, as the load does), its
    RNG states and per-rank state. None when some rank cannot plan (the load says why)."""
    try:
        planner = DefaultLoadPlanner(allow_partial_load=not strict)
        planner.set_up_planner(state_dicts(state), metadata, rank == 0)
        plan: LoadPlan | None = planner.create_local_plan()
    except Exception as exc:  # noqa: BLE001 (the load itself raises it, on every rank)
        log.debug("deepnvme.CheckpointManager: no read plan ahead of the load: %s", exc)
        plan = None
    plans = gather(plan)
    if any(p is None for p in plans):
        return None
    info = metadata.storage_data
    out = []
    for r, final in enumerate(schedule(plans, metadata, local)):
        srcs = final.storage_data.srcs() if isinstance(final.storage_data, Schedule) else {}
        mine = {req.storage_index for req in final.items if srcs.get(key_of(req), r) == r}
        own = (f"{rng_key}.{rng_entry(r)}.", f"{RANK_STATE_KEY}.{rng_entry(r)}")
        mine |= {index for index in info if index.fqn.startswith(own)}
        out.append(sorted({(os.fspath(info[i].relative_path), info[i].offset, info[i].length) for i in mine}))
    return out


def _read(path: str, step: int, saved: dict[str, Any], *, group: Any, config: IOConfig, partial: bool = False,
          sums: ItemSums | None, hints: ReadHints | None = None, drives: StepDrives | None = None) -> None:
    """:func:`read_step`, a failed item checksum named with the step."""
    try:
        read_step(path if drives is None else drives.at(path), saved, group=group, config=config,
                  partial=partial, sums=sums, hints=hints)
    except CheckpointCorruptError as exc:
        raise CheckpointCorruptError(f"checkpoint step {step} in {os.path.dirname(path)!r} is corrupt: "
                                     f"{exc}") from exc


def restore_dcp(path: str, step: int, state: MutableMapping[str, Any], *, group: Any, rank: int, world: int,
                rng_key: str | None, config: IOConfig, strict: bool, rank_state: Any = None,
                verify: bool = False, hints: ReadHints | None = None, drives: StepDrives | None = None) -> None:
    """Load the multi-rank step at ``path`` into ``state`` (DCP reshards when ``world`` differs
    from the saving world), then this rank's RNG states when ``rng_key`` is given and the world
    size is unchanged (otherwise they are left alone, with a warning) and its per-rank state into
    ``rank_state`` (see :mod:`._rank_state`; checked before anything is read). ``verify``: check
    every file's size and stored checksum first (one process reading a step alone). ``hints``:
    where the nodes gathered the step's files (see :class:`~._dcp_step.ReadHints`). ``drives``:
    the manager's folders on a volume (``path`` is drive 0's; data files on their drives)."""
    if drives is not None and not drives.holds(path):
        drives = None  # a plain folder (the durable tier's copy): every file in it
    manifest = read_manifest(path, step)
    saved_world = int(manifest.get("world_size", 0))
    own_state = refuse_other_world(rank_state_keys(manifest), saved_world=saved_world, world=world,
                                   rank_state=rank_state, what=f"checkpoint step {step}")
    if verify and (wrong := check_step_files(path, files_to_check(manifest, world),
                                             drives=None if drives is None else drives.across(path))):
        raise CheckpointCorruptError(f"checkpoint step {step}: {'; '.join(wrong)}")
    sums = item_sums(manifest)
    saved = state_dicts(state)
    _read(path, step, saved, group=group, config=config, partial=not strict, sums=sums, hints=hints,
          drives=drives)
    load_into(state, saved, strict=strict)
    holder: dict[str, Any] = {}
    own_state = own_state and rng_entry(rank) in (manifest.get("rank_state") or {})
    if own_state:
        holder[RANK_STATE_KEY] = {rng_entry(rank): b""}
    if rng_key is not None and saved_world != world:
        log.warning("deepnvme.CheckpointManager: step %d was saved by %s ranks, restored by %d: RNG "
                    "states are left as they are", step, manifest.get("world_size"), world)
    elif rng_key is not None:
        stored = NVMeStorageReader(path, config=config).read_metadata().state_dict_metadata  # drive 0's
        if any(key.startswith(f"{rng_key}.{rng_entry(rank)}.") for key in stored):  # else rng=False
            holder[rng_key] = {rng_entry(rank): capture_rng()}
    if not holder:
        return
    _read(path, step, holder, group=None, config=config, sums=sums, hints=hints, drives=drives)
    if own_state:
        fill(rank_state, unpack(holder[RANK_STATE_KEY][rng_entry(rank)]))
    if rng_key is not None and rng_key in holder:
        restore_rng(holder[rng_key][rng_entry(rank)])
