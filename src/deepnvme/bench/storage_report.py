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
from .report import FAIL, Check

__all__ = ["StorageReport", "StorageFacts", "QueueFacts", "RaidFacts", "run_storage_report",
           "gather_storage_facts", "storage_checks"]


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
