"""The candidate settings ``deepnvme tune`` sweeps: built in, or read from a ``--space`` file,
less the engines this system cannot run; and where the pruned search starts."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from ..config import ENGINE_NAMES, SETTINGS, parse_size, resolve_config
from ..errors import ConfigError, DeepNVMeError
from ._engines import EngineStatus
from ._search import Value, closest

__all__ = ["DIMENSIONS", "NO_EFFECT", "TuneSpace", "default_space", "load_space", "complete",
           "runnable", "start_point"]

DIMENSIONS = ("engine", "intra_op_parallelism", "block_size", "queue_depth", "single_submit")
NO_EFFECT = ("overlap_events",)
_ALIASES = {"thread_count": "intra_op_parallelism"}


@dataclasses.dataclass(frozen=True)
class TuneSpace:
    """Candidate values per swept setting in search order (numbers ascending, engines fastest
    first), plus notes about what is not swept."""

    dims: Mapping[str, tuple[Value, ...]]
    notes: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        n = 1
        for values in self.dims.values():
            n *= len(values)
        return n


_NO_EFFECT_NOTE = ("overlap_events is not swept: every engine overlaps submission and completion "
                   "(it is written as false)")
_SINGLE_SUBMIT_NOTE = ("single_submit is not swept: it is written as false (batched submission, "
                       "DeepSpeed's default); to sweep it, list \"single_submit\": [false, true] "
                       "in a --space file")


def default_space() -> TuneSpace:
    """Every engine (those this system cannot run are dropped by :func:`run_tune`), threads
    1-16, blocks 128 KiB-16 MiB, queue depths 8-128 (600 combinations); single_submit false."""
    return TuneSpace({"engine": ENGINE_NAMES, "intra_op_parallelism": (1, 2, 4, 8, 16),
                      "block_size": tuple(1 << s for s in range(17, 25)),
                      "queue_depth": (8, 16, 32, 64, 128), "single_submit": (False,)},
                     (_NO_EFFECT_NOTE, _SINGLE_SUBMIT_NOTE))


def load_space(path: str) -> TuneSpace:
    """Read a space from JSON or YAML: ``{"engine": ["io_uring", "threads"], "block_size":
    ["256K", "1M"], "queue_depth": [32], ...}``; missing dimensions keep the default candidates."""
    with open(path) as f:
        text = f.read()
    if path.endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ConfigError("reading a YAML space needs PyYAML (pip install pyyaml); "
                              "or write the space as JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML ({' '.join(str(exc).split())})") from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, Mapping) and isinstance(data.get("aio"), Mapping):
        data = data["aio"]
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping of setting name to list of values")
    dims = dict(default_space().dims)
    notes = [_NO_EFFECT_NOTE]
    for key, raw in data.items():
        name = _ALIASES.get(key, key)
        values = raw if isinstance(raw, list) else [raw]
        if name in NO_EFFECT or name == "single_submit":
            if not all(isinstance(v, bool) for v in values):
                raise ConfigError(f"{path}: {key} takes JSON booleans, got {values!r}")
        if name in NO_EFFECT:
            if len(set(values)) > 1 or True in values:
                notes.append(f"{key}={values} ignored: it has no effect in any engine")
            continue
        if name not in DIMENSIONS:
            raise ConfigError(f"{path}: unknown setting {key!r}; tune sweeps {list(DIMENSIONS)} "
                              f"(and accepts {list(NO_EFFECT)})")
        if not values:
            raise ConfigError(f"{path}: {key} has no values")
        dims[name] = _parse_values(path, key, name, values)
    if len(dims["single_submit"]) < 2:
        notes.append(_SINGLE_SUBMIT_NOTE if dims["single_submit"] == (False,) else
                     "single_submit is not swept: it is written as true (--space)")
    return TuneSpace(dims, tuple(notes))


def _parse_values(path: str, key: str, name: str, values: list[Any]) -> tuple[Value, ...]:
    """A space file's candidates for one setting, in search order."""
    if name == "single_submit":
        return tuple(sorted(set(values)))
    if name == "engine":
        bad = [v for v in values if v not in ENGINE_NAMES]
        if bad:
            raise ConfigError(f"{path}: engine {bad[0]!r} is not one of {list(ENGINE_NAMES)}")
        return tuple(e for e in ENGINE_NAMES if e in values)  # preference order
    parsed = sorted({parse_size(v) for v in values})
    minimum = next(s.minimum for s in SETTINGS if s.name == name) or 1
    if parsed[0] < minimum:
        raise ConfigError(f"{path}: {key} values must be >= {minimum}, got {parsed[0]}")
    return tuple(parsed)


def complete(space: TuneSpace) -> TuneSpace:
    """``space`` with the default candidates for any setting it leaves out."""
    return TuneSpace({**default_space().dims, **space.dims}, space.notes)


def runnable(space: TuneSpace, statuses: tuple[EngineStatus, ...]) -> TuneSpace:
    """``space`` without the engines this system cannot run, each dropped one named in a note."""
    wanted = space.dims["engine"]
    missing = [e for e in statuses if e.name in wanted and not e.available]
    engines = tuple(e for e in wanted if e not in {m.name for m in missing})
    if not engines:
        raise DeepNVMeError("none of the engines to sweep runs here ("
                            + "; ".join(f"{m.name}: {m.detail}" for m in missing)
                            + "); see 'deepnvme report' and list others in --space")
    notes = tuple(f"engine {m.name} not swept: not available here ({m.detail})" for m in missing)
    return TuneSpace({**space.dims, "engine": engines}, space.notes + notes)


def start_point(dims: Mapping[str, tuple[Value, ...]], auto: str) -> dict[str, Value]:
    """Where the coordinate search starts: the engine ``auto`` picks and DeepSpeed's defaults
    (or the candidates nearest to them)."""
    defaults = resolve_config()
    start: dict[str, Value] = {}
    for name, values in dims.items():
        default = auto if name == "engine" else getattr(defaults, name)
        if default in values:
            start[name] = default
        elif name in ("engine", "single_submit"):
            start[name] = values[0]
        else:
            start[name] = closest([int(v) for v in values], int(default))
    return start
