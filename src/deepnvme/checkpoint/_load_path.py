"""Which way the loaders read CPU tensors on a device: the engine (O_DIRECT) or a mapping.

Two paths move a checkpoint into CPU memory. ``direct``: the engine reads with O_DIRECT into
aligned memory (new memory for a fresh load, the target's for ``load_into``). ``mapped``: a
private mapping of the file is read in through the page cache by parallel
``MADV_POPULATE_READ`` (a fresh load keeps views of it; ``load_into`` copies from it). Which is
faster depends on the device: a disk whose readahead issues larger requests than the engine's
chunks serves the mapping faster, and new anonymous memory is zeroed by the kernel before an
O_DIRECT read lands in it while page-cache pages are not.

:func:`load_paths` answers per device. ``load_path`` in the config forces one path; ``auto``
(the default) takes the cached measurement of the file's device, made on first use by
:func:`measure` on the file being loaded (cold slices of it, both paths alternating) and kept
in ``$DEEPNVME_CACHE_DIR/load-paths.json`` (default ``~/.cache/deepnvme``), keyed by device
and kernel. ``deepnvme tune --load`` remeasures with whole cold loads of a scratch file, each in
a fresh process (:mod:`._load_probe`); ``deepnvme report`` shows the
choice and why.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

from ..config import IOConfig
from ..errors import DeepNVMeError
from ..handles.aio import AioHandle
from ..io import durable
from ..io.mapped import map_private, populate, release
from ..io.posix import evict_page_cache
from ..memory.views import aligned_empty, storage_bytes

__all__ = ["LoadPaths", "Path", "PROBE_SLICE", "MARGIN", "choose", "measure", "load_paths",
           "cache_file", "cached_paths", "forget", "device_of", "lookup", "remeasure",
           "WHOLE_MARGIN", "WHOLE_BYTES", "KINDS", "undecided"]

log = logging.getLogger(__name__)

Path = Literal["direct", "mapped"]

PROBE_SLICE = 32 << 20
"""Bytes per timed read of the first-use measurement (each one a cold slice of the file)."""
PROBE_ROUNDS = 3
"""Rounds of the four timings (fewer where the file is small); a file too small for one round
is not measured."""
MARGIN = 1.5
"""The mapped path is chosen only when at least this much faster than ``direct``: ``direct``
gives the caller memory of its own, not views of the page cache, and the slices overstate
the mapped path (benchmarks/LOG.md, 2026-11-28: 1.25x in the probe on the development disk,
0.56x in whole-file loads there the same hour)."""
WHOLE_MARGIN = 1.1
"""The margin for :func:`measure_whole`'s timings, which are the loads themselves."""
WHOLE_BYTES = 1 << 30
"""The size of ``deepnvme tune --load``'s probe file (whole-file timings)."""
KINDS = ("fresh_direct", "fresh_mapped", "into_direct", "into_mapped")
"""The four timings: a fresh load or ``load_into``, through O_DIRECT or the mapping."""
_FORMAT = "deepnvme-load-paths"
_VERSION = 1


@dataclasses.dataclass(frozen=True)
class LoadPaths:
    """The path for fresh loads (``fresh``) and for ``load_into`` (``into``) on one device,
    and why: ``rates`` are GB/s (1e9 bytes) of each timing, ``source`` says where the choice
    came from (``measured``, ``cache``, ``setting`` or ``default``)."""

    device: str
    fresh: Path
    into: Path
    reason: str
    source: str
    rates: Mapping[str, float] = dataclasses.field(default_factory=dict)
    measured_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "fresh": self.fresh, "into": self.into,
                "reason": self.reason, "source": self.source, "rates": dict(self.rates),
                "measured_at": self.measured_at}


def choose(rates: Mapping[str, float], *, margin: float = MARGIN,
           slices: bool = False) -> tuple[Path, Path, str]:
    """The fresh and into paths from measured GB/s (keys ``fresh_direct``, ``fresh_mapped``,
    ``into_direct``, ``into_mapped``) and the reason in words. ``slices``: the rates come from
    :func:`measure`'s slices, so a mapped path ahead but inside the margin is named as
    undecided, with the command that times whole loads (the slices have misjudged whole loads
    by 2x either way: benchmarks/LOG.md 2026-11-28, 2026-12-07). Pure."""
    picks: list[Path] = []
    words = []
    for kind in ("fresh", "into"):
        direct, mapped = rates[f"{kind}_direct"], rates[f"{kind}_mapped"]
        pick: Path = "mapped" if mapped >= direct * margin else "direct"
        picks.append(pick)
        words.append(f"{kind}: mapped {mapped:.2f} GB/s vs O_DIRECT {direct:.2f} GB/s -> {pick}")
        if slices and _inside_margin(direct, mapped, margin):
            words[-1] += (f" (mapped ahead by less than the probe's {margin:.1f}x margin: "
                          "`deepnvme tune --load` times whole loads)")
    return picks[0], picks[1], "; ".join(words)


def _inside_margin(direct: float, mapped: float, margin: float) -> bool:
    """Mapped ahead of direct, but by less than ``margin``: direct is kept, undecided."""
    return direct < mapped < direct * margin


def undecided(rates: Mapping[str, float], *, margin: float = MARGIN) -> bool:
    """Whether :func:`choose` kept ``direct`` for a kind where mapped was ahead inside the margin."""
    return any(_inside_margin(rates[f"{k}_direct"], rates[f"{k}_mapped"], margin) for k in ("fresh", "into"))


def device_of(path: str) -> tuple[str, str]:
    """``(key, name)`` of the block device holding ``path``: ``"major:minor"`` and its kernel
    name (``vda``, ``nvme0n1p1``, ``loop0``), or the key again where sysfs does not say."""
    dev = os.stat(path).st_dev
    key = f"{os.major(dev)}:{os.minor(dev)}"
    name = os.path.basename(os.path.realpath(f"/sys/dev/block/{key}"))  # the key where sysfs lacks it
    return key, name or key


def cache_file() -> str:
    """Where measured choices are kept: ``$DEEPNVME_CACHE_DIR``, else ``$XDG_CACHE_HOME/deepnvme``,
    else ``~/.cache/deepnvme``; the file ``load-paths.json`` in it."""
    folder = os.environ.get("DEEPNVME_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "deepnvme")
    return os.path.join(folder, "load-paths.json")


_lock = threading.Lock()
_memo: dict[str, LoadPaths] = {}


def _entry_key(device_key: str) -> str:
    return f"{device_key}@{platform.release()}"


def cached_paths() -> dict[str, LoadPaths]:
    """Every choice in the cache file (entry key ``major:minor@kernel`` -> choice); an absent
    or damaged file is empty (a damaged one is logged and remeasured over)."""
    path = cache_file()
    try:
        with open(path, encoding="utf-8") as f:
            data: Any = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.warning("deepnvme: load-path cache %s unreadable (%s); measuring again", path, exc)
        return {}
    if not isinstance(data, dict) or data.get("format") != _FORMAT or data.get("version") != _VERSION:
        return {}
    out = {}
    for key, e in (data.get("devices") or {}).items():
        try:
            out[key] = LoadPaths(device=str(e["device"]), fresh=_path(e["fresh"]), into=_path(e["into"]),
                                 reason=str(e["reason"]), source="cache",
                                 rates={k: float(v) for k, v in e.get("rates", {}).items()},
                                 measured_at=e.get("measured_at"))
        except (KeyError, TypeError, ValueError):
            log.warning("deepnvme: load-path cache %s: entry %r damaged; ignored", path, key)
    return out


def _path(value: object) -> Path:
    if value == "direct" or value == "mapped":
        return value
    raise ValueError(f"not a load path: {value!r}")


def _store(key: str, choice: LoadPaths) -> None:
    """Add ``choice`` to the cache file (durably); an unwritable cache is logged, not raised."""
    path = cache_file()
    entries = {k: v.to_dict() for k, v in cached_paths().items()}
    entries[key] = {**choice.to_dict(), "source": "measured"}
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        durable.write_json(path, {"format": _FORMAT, "version": _VERSION, "devices": entries}, indent=1)
    except OSError as exc:
        log.warning("deepnvme: cannot write the load-path cache %s (%s); the choice for %s holds "
                    "for this process only", path, exc, choice.device)


def forget() -> None:
    """Drop this process's memo of choices (the cache file stays)."""
    with _lock:
        _memo.clear()


def load_paths(path: str, cfg: IOConfig, *,
               measure_fn: Callable[[str, IOConfig], Mapping[str, float] | None] | None = None
               ) -> LoadPaths:
    """The paths for loading ``path`` (a file) under ``cfg``: the ``load_path`` setting if not
    ``auto``; else this device's cached choice; else measured now on ``path`` and cached (a
    file too small to measure gets ``direct``, uncached). Thread-safe; blocks while measuring."""
    key, name = device_of(path)
    if cfg.load_path != "auto":
        forced = _path(cfg.load_path)
        return LoadPaths(name, forced, forced, f"load_path={forced!r} set", "setting")
    if not cfg.o_direct:
        return LoadPaths(name, "direct", "direct", "o_direct=False: the engine's buffered reads",
                         "setting")
    entry = _entry_key(key)
    with _lock:
        if entry in _memo:
            return _memo[entry]
        found = cached_paths().get(entry)
        if found is not None:
            _memo[entry] = found
            return found
        rates = (measure_fn or measure)(path, cfg)
        if rates is None:
            return LoadPaths(name, "direct", "direct", f"{path!r} is too small to measure on; "
                             "direct until a larger file or `deepnvme tune --load` measures", "default")
        fresh, into, why = choose(rates, slices=True)
        choice = LoadPaths(name, fresh, into, why, "measured", dict(rates), time.time())
        log.log(logging.WARNING if undecided(rates) else logging.INFO,
                "deepnvme: loads on %s (%s) take fresh=%s, into=%s: %s (measured on %s)",
                name, key, fresh, into, why, path)
        _memo[entry] = choice
        _store(entry, choice)
        return choice


def remeasure(path: str, cfg: IOConfig, *, rates: Mapping[str, float] | None = None) -> LoadPaths:
    """Measure on ``path`` now (slices; or take the whole-file ``rates`` of
    :func:`._load_probe.measure_whole`), replacing the device's cached choice. Raises
    :class:`DeepNVMeError` if ``path`` is too small for one round."""
    key, name = device_of(path)
    whole = rates is not None
    rates = rates if rates is not None else measure(path, cfg)
    if rates is None:
        raise DeepNVMeError(f"{path!r}: need at least {4 * PROBE_SLICE} bytes to measure load paths")
    fresh, into, why = choose(rates, margin=WHOLE_MARGIN if whole else MARGIN, slices=not whole)
    if whole:
        why = f"whole {os.path.getsize(path) / 1e9:.2f} GB loads in fresh processes: {why}"
    choice = LoadPaths(name, fresh, into, why, "measured", dict(rates), time.time())
    entry = _entry_key(key)
    with _lock:
        _memo[entry] = choice
        _store(entry, choice)
    return choice


def measure(path: str, cfg: IOConfig) -> dict[str, float] | None:
    """GB/s of each path on cold slices of ``path``: ``fresh_direct`` (O_DIRECT into new
    memory), ``fresh_mapped`` (populate a range of a private mapping, then read one byte of
    each page: on some virtual machines the first access of a page the device filled costs
    more than the read, and a caller would pay it later), ``into_direct``
    (O_DIRECT into touched memory), ``into_mapped`` (populate, then copy into touched memory).
    Rounds alternate the order; medians. Evicts ``path`` from the page cache first (its next
    read is cold). None if the file is smaller than one round (four slices). Blocks; holds
    ``2 x PROBE_SLICE`` bytes of memory while it runs."""
    size = os.path.getsize(path)
    rounds = min(PROBE_ROUNDS, size // (4 * PROBE_SLICE))
    if rounds == 0:
        return None
    evict_page_cache(path)
    kinds = KINDS
    times: dict[str, list[float]] = {k: [] for k in kinds}
    mapping = map_private(path)
    touched = aligned_empty(PROBE_SLICE, 0, min_bytes=0)
    touched.fill_(1)
    slot = 0
    threads = cfg.intra_op_parallelism
    chunk = max(1 << 20, PROBE_SLICE // threads)  # every thread busy, as on a whole file
    with AioHandle(config=cfg.replace(load_path="direct")) as handle:
        for r in range(rounds):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                offset = slot * PROBE_SLICE
                slot += 1
                t0 = time.perf_counter()
                if kind.endswith("direct"):
                    buf = aligned_empty(PROBE_SLICE, offset) if kind == "fresh_direct" else touched
                    handle.submit_read(buf, path, offset=offset).result()
                    del buf  # at most one new slice alive
                else:
                    part = mapping[offset:offset + PROBE_SLICE]
                    populate(part, path=path, threads=threads, chunk=chunk, offset=offset)
                    data = storage_bytes(part)
                    if kind == "into_mapped":
                        touched.copy_(data)
                    else:  # the first access of each page, which a caller pays later otherwise
                        data[::4096].sum()
                times[kind].append(time.perf_counter() - t0)
                if not kind.endswith("direct"):
                    release(part)  # at most one slice of the file mapped at a time
    return {k: PROBE_SLICE / statistics.median(v) / 1e9 for k, v in times.items()}


def lookup(path: str) -> LoadPaths | None:
    """The choice already made for the device holding ``path`` (a file or directory): this
    process's, else the cache file's; None if not measured yet. Measures nothing."""
    key, _ = device_of(path)
    entry = _entry_key(key)
    with _lock:
        if entry in _memo:
            return _memo[entry]
    return cached_paths().get(entry)
