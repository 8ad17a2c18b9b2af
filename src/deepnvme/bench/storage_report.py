"""``deepnvme report --storage PATH``: what to change in the storage under a path, each with
the command that changes it.

:func:`run_storage_report` gathers the facts (:func:`gather_storage_facts`: the mount, its
options, the devices down to the drives, a RAID, free space, an O_DIRECT probe) and runs the
pure checks of :func:`storage_checks` against deepnvme's settings (``block_size``,
``queue_depth``, ``intra_op_parallelism``, ``alignment``, resolved as handles resolve them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..config import IOConfig, resolve_config
from ._storage_checks import storage_checks
from ._storage_facts import QueueFacts, RaidFacts, StorageFacts, gather_storage_facts
from .report import FAIL, OK, UNKNOWN, WARN, Check

__all__ = ["StorageReport", "StorageFacts", "QueueFacts", "RaidFacts", "run_storage_report",
           "gather_storage_facts", "storage_checks", "volume_check"]


@dataclasses.dataclass(frozen=True)
class StorageReport:
    """The storage checks for ``path``: ``need_bytes`` is what a job will need (None: not
    given), ``config`` the settings checked against, ``facts`` what was read."""

    path: str
    need_bytes: int | None
    config: IOConfig
    facts: StorageFacts
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        """True when no check FAILed."""
        return all(c.status != FAIL for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        keys = ("block_size", "queue_depth", "intra_op_parallelism", "alignment")
        return {"path": self.path, "ok": self.ok, "need_bytes": self.need_bytes,
                "settings": {k: getattr(self.config, k) for k in keys},
                "facts": dataclasses.asdict(self.facts),
                "checks": [dataclasses.asdict(c) for c in self.checks]}


def run_storage_report(path: str, *, need: int | None = None, root: str = "/",
                       config: IOConfig | None = None, probe: bool = True) -> StorageReport:
    """Check the storage under ``path`` (blocking, milliseconds). ``need``: bytes a job will
    write there; ``root``: where ``proc/`` and ``sys/`` are read; ``config``: the settings to
    check against (default: resolved from the environment); ``probe``: write, read and delete
    one page with O_DIRECT in ``path``."""
    config = resolve_config(config)
    facts = gather_storage_facts(path, root=root, probe=probe)
    return StorageReport(path=facts.path, need_bytes=need, config=config, facts=facts,
                         checks=storage_checks(facts, config, need=need))


def _drives(facts: StorageFacts) -> frozenset[str]:
    """The drives under a path: its physical devices, else its mount (tmpfs, network)."""
    if facts.leaves:
        return frozenset(d.name for d in facts.leaves)
    return frozenset({f"mount {facts.mount.dev}"} if facts.mount else ())


def volume_check(facts: list[StorageFacts]) -> Check:
    """For the directories of a volume (one per drive): a WARN where two share a drive, since
    striping over them then adds no bandwidth. Pure."""
    drives = [_drives(f) for f in facts]
    if any(not d for d in drives):
        return Check("volume", UNKNOWN, "the drives under some paths are unknown",
                     "check with lsblk that each directory is on its own drive",
                     command="lsblk -o NAME,MOUNTPOINTS")
    shared = sorted({f"{a.path} and {b.path}" for i, a in enumerate(facts)
                     for b, db in zip(facts[i + 1:], drives[i + 1:]) if drives[i] & db})
    value = f"{len(facts)} directories on {len(frozenset().union(*drives))} drive(s)"
    if not shared:
        return Check("volume", OK, value)
    return Check("volume", WARN, value + f"; {', '.join(shared)} share a drive",
                 "give a volume one directory per drive (striping over one drive adds nothing)",
                 command="lsblk -o NAME,MOUNTPOINTS")
