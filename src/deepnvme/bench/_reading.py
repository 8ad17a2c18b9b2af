"""What ``deepnvme bench load`` and ``deepnvme bench data`` share: whether a reader's package
imports, and making files cold before each timed read (and checking, with ``mincore``, that
they are)."""

from __future__ import annotations

import importlib
import logging
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Protocol

from ..io.posix import evict_page_cache, resident_bytes

__all__ = ["EVICTIONS", "missing_module", "pick_eviction", "evict", "cache_state", "check_cold",
           "overall_cache"]

log = logging.getLogger(__name__)
DROP_CACHES = "/proc/sys/vm/drop_caches"
EVICTIONS = ("auto", "drop-caches", "fadvise", "none")


class _NeedsModule(Protocol):
    @property
    def module(self) -> str: ...


def missing_module(reader: _NeedsModule) -> str | None:
    """Why ``reader`` cannot run here (its package does not import), or None. Imports it, so
    the import is not part of the first timed read (import-time warnings are not shown)."""
    try:
        with warnings.catch_warnings():  # e.g. megatron-core: "Apex is not installed"
            warnings.simplefilter("ignore")
            importlib.import_module(reader.module)
    except ImportError as exc:
        return f"{reader.module} is not installed ({exc})"
    return None


def pick_eviction(mode: str) -> str:
    """``auto``: drop the whole page cache where allowed (root), else ``fadvise`` the files."""
    if mode != "auto":
        return mode
    return "drop-caches" if os.geteuid() == 0 and os.access(DROP_CACHES, os.W_OK) else "fadvise"


def _drop_caches() -> None:
    os.sync()
    with open(DROP_CACHES, "w") as f:
        f.write("3\n")


def evict(files: tuple[str, ...], how: str, *, drop: Callable[[], None] | None = None) -> str:
    """Drop ``files`` from the page cache ``how`` (``drop-caches``, ``fadvise``, ``none``);
    returns the way used (``fadvise`` when writing drop_caches is refused). ``drop``: for tests."""
    if how == "drop-caches":
        try:
            (drop or _drop_caches)()
            return how
        except OSError as exc:
            log.warning("cannot write %s (%s): evicting the files with fadvise", DROP_CACHES, exc)
            how = "fadvise"
    if how == "fadvise":
        for f in files:
            evict_page_cache(f)
    return how


def cache_state(resident: int | None, total: int) -> str:
    """``cold`` when at most 1 % of the ``total`` bytes are in the page cache, else ``warm``
    (also when ``resident`` could not be measured: None)."""
    return "cold" if resident is not None and resident * 100 <= total else "warm"


def overall_cache(states: Iterable[str]) -> str:
    """``cold`` or ``warm`` when every run was, else ``mixed``."""
    distinct = set(states)
    return distinct.pop() if len(distinct) == 1 else "mixed"


def check_cold(files: tuple[str, ...]) -> tuple[int | None, str]:
    """(bytes of ``files`` in the page cache, :func:`cache_state`); None where mincore fails."""
    try:
        resident: int | None = sum(resident_bytes(f) for f in files)
    except OSError as exc:
        log.warning("cannot tell whether the files are cached (%s): marked warm", exc)
        resident = None
    return resident, cache_state(resident, sum(os.path.getsize(f) for f in files))
