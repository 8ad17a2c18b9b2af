"""The on-disk layout of a :class:`~deepnvme.CheckpointManager` directory.

::

    DIR/.deepnvme-writer.lock          the one-writer lock (see _lock.py)
    DIR/step-000000000100/state.pt     torch.save format: {name: state dict | tensor | data, ...}
    DIR/step-000000000100/manifest.json  step, file size, per-tensor sizes and checksums
    DIR/.step-000000000200.deepnvme-building-<pid>-<rand>/   a save in progress (or a killed one's)
    DIR/.step-000000000050.deepnvme-deleting-<pid>-<rand>/   retention removing an old step

A step directory appears in one rename (:func:`deepnvme.io.durable.publish_dir`) with both files
fsynced, so a listed step is complete. Retention first renames a step away, then removes it, so
a killed removal never leaves a partial ``step-*`` directory. Hidden ``.step-*`` directories are
removed by the next writer (it holds the lock, so nothing else can be writing them).
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
from typing import Any

from ...errors import CheckpointCorruptError
from ...io import durable

__all__ = ["FILE", "MANIFEST", "FORMAT", "RANK_STATE_KEY", "step_dir", "find_step_dirs", "list_steps",
           "is_dcp_step", "new_building", "building_path", "new_token", "delete_step", "remove_leftovers",
           "find_leftovers", "read_manifest"]

log = logging.getLogger(__name__)

FILE = "state.pt"
MANIFEST = "manifest.json"
FORMAT = "deepnvme-checkpoint-manager"
RANK_STATE_KEY = "_deepnvme_rank_state"  # the reserved entry holding save(rank_state=...)
_STEP_RE = re.compile(r"^step-(\d+)$")
_LEFTOVER_RE = re.compile(r"^\.step-\d+\.deepnvme-(building|deleting)-\d+-[0-9a-f]+$")


def step_dir(directory: str, step: int) -> str:
    """Where step ``step`` is committed: ``DIR/step-<step, 12 digits at least>``."""
    return os.path.join(directory, f"step-{step:012d}")


def find_step_dirs(directory: str) -> list[tuple[int, str]]:
    """Every ``step-N`` directory in ``directory``, complete or not: ``(N, path)``, ascending.

    The manager never leaves an incomplete one (it publishes in one rename); ``deepnvme verify``
    reports those that lost files some other way."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for name in names:
        m = _STEP_RE.match(name)
        path = os.path.join(directory, name)
        if m is not None and os.path.isdir(path):
            found.append((int(m.group(1)), path))
    return sorted(found)


def list_steps(directory: str) -> list[int]:
    """The committed steps in ``directory`` (a ``step-N`` directory holding a manifest), ascending."""
    return [step for step, path in find_step_dirs(directory) if os.path.isfile(os.path.join(path, MANIFEST))]


def is_dcp_step(path: str) -> bool:
    """Whether the step directory ``path`` holds a torch.distributed.checkpoint checkpoint (one
    that several ranks saved: ``.metadata`` and data files instead of ``state.pt``)."""
    return os.path.isfile(os.path.join(path, ".metadata"))


def _hidden(directory: str, step: int, kind: str, token: str | None = None) -> str:
    return os.path.join(directory, f".step-{step:012d}.deepnvme-{kind}-{token or new_token()}")


def new_token() -> str:
    """What makes a hidden directory's name unique to this process: its pid and random bits."""
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def building_path(directory: str, step: int, token: str | None = None) -> str:
    """A hidden building directory name for ``step`` (not created): fresh, or made of ``token``
    (:func:`new_token`) so that every rank that got the token names it alike."""
    return _hidden(directory, step, "building", token)


def new_building(directory: str, step: int) -> str:
    """Create and return an empty hidden directory in which step ``step`` is written."""
    path = _hidden(directory, step, "building")
    os.mkdir(path)
    return path


def delete_step(directory: str, step: int) -> None:
    """Remove committed step ``step``: renamed away first (durably), then deleted."""
    gone = _hidden(directory, step, "deleting")
    os.rename(step_dir(directory, step), gone)
    durable.fsync_dir(directory)
    shutil.rmtree(gone)


def find_leftovers(directory: str) -> list[str]:
    """Hidden building/deleting directories in ``directory`` (sorted paths)."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    return [os.path.join(directory, n) for n in names if _LEFTOVER_RE.match(n)]


def remove_leftovers(directory: str) -> list[str]:
    """Remove what killed saves and removals left (call only while holding the directory's
    lock); each removal is logged. Returns the removed paths."""
    removed = []
    for path in find_leftovers(directory):
        shutil.rmtree(path, ignore_errors=False)
        log.warning("deepnvme.CheckpointManager: removed %s, left by an interrupted save or removal", path)
        removed.append(path)
    return removed


def read_manifest(path: str, step: int | None = None) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path``; :class:`CheckpointCorruptError` if it
    is missing or unreadable."""
    what = f"step {step}" if step is not None else repr(path)
    file = os.path.join(path, MANIFEST)
    try:
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"checkpoint {what} is incomplete: {file!r} is missing") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(f"checkpoint {what}: {file!r} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"checkpoint {what}: {file!r} is not a deepnvme checkpoint manifest")
    return manifest
