"""The I/O engines as the commands see them: which ones run here, which one ``auto`` picks,
parsing ``--engine`` lists, and how many chunks an engine keeps in flight."""

from __future__ import annotations

import dataclasses

from ..config import ENGINE_NAMES, IOConfig
from ..errors import ConfigError, DeepNVMeError
from ..io.choice import Choice, auto_choices

__all__ = ["EngineStatus", "engine_statuses", "parse_engines", "require_engines", "in_flight",
           "auto_per_transfer", "describe_choices"]


@dataclasses.dataclass(frozen=True)
class EngineStatus:
    """One engine on this system: ``available`` or not, ``detail`` (what it is, or why not),
    and whether ``auto`` picks it."""

    name: str
    available: bool
    detail: str
    auto: bool

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def engine_statuses() -> tuple[EngineStatus, ...]:
    """Every engine in :data:`~deepnvme.config.ENGINE_NAMES` order, probed once; ``auto`` marks
    the first available one, as a handle built with ``engine="auto"`` picks (a test holds the
    two equal)."""
    from ..io.engine import probe_engines

    probes = probe_engines()
    picked = next((p.name for p in probes if p.available), None)
    return tuple(EngineStatus(p.name, p.available, p.detail, p.name == picked) for p in probes)


def auto_per_transfer(statuses: tuple[EngineStatus, ...]) -> tuple[Choice, ...]:
    """The mover ``engine="auto"`` gives each class of transfer with the engines that run
    here (:func:`~deepnvme.io.choice.auto_choices`); empty when it uses one for all."""
    from ..io.movers import registers_buffers

    available = tuple(s.name for s in statuses if s.available)
    choices = auto_choices(available, "io_uring" in available and registers_buffers())
    return choices if len({c.mover for c in choices}) > 1 else ()


def describe_choices(choices: tuple[Choice, ...]) -> str:
    """``"large direct read: aio (why); ..."``: one line for the report and tune."""
    return "; ".join(f"{c.transfer}: {c.mover} ({c.why})" for c in choices)


def parse_engines(text: str) -> tuple[str, ...]:
    """``"io_uring,threads"`` -> ("io_uring", "threads"); ``auto`` is kept as given (resolve it
    with :func:`require_engines`). Duplicates are dropped; an unknown name raises."""
    names = [s.strip().lower() for s in text.split(",") if s.strip()]
    if not names:
        raise ConfigError("--engine is empty; give NAME[,NAME...] from: auto, "
                          + ", ".join(ENGINE_NAMES))
    for name in names:
        if name not in ("auto",) + ENGINE_NAMES:
            raise ConfigError(f"--engine: unknown engine {name!r}; choose from: auto, "
                              + ", ".join(ENGINE_NAMES))
    return tuple(dict.fromkeys(names))


def require_engines(names: tuple[str, ...], statuses: tuple[EngineStatus, ...]
                    ) -> tuple[str, ...]:
    """Resolve ``auto`` to the engine it picks, drop duplicates, and raise (naming the reason)
    for an engine this system cannot run: a benchmark never falls back silently."""
    by_name = {s.name: s for s in statuses}
    picked = next((s.name for s in statuses if s.auto), None)
    if picked is None:
        raise DeepNVMeError("no I/O engine runs here (see 'deepnvme report')")
    resolved = tuple(dict.fromkeys(picked if n == "auto" else n for n in names))
    for name in resolved:
        status = by_name.get(name)
        if status is None:
            raise ConfigError(f"unknown engine {name!r}; choose from: auto, "
                              + ", ".join(by_name))
        if not status.available:
            raise DeepNVMeError(f"engine {name!r} is not available here: {status.detail} "
                                "(see 'deepnvme report'); available: "
                                + ", ".join(s.name for s in statuses if s.available))
    return resolved


def in_flight(config: IOConfig, engine: str) -> int:
    """Chunk requests a handle keeps in flight at once: ``queue_depth`` per worker thread with
    the kernel engines, ``queue_depth`` in all with ``threads`` (see the settings table)."""
    if engine == "threads":
        return config.queue_depth
    return config.queue_depth * config.intra_op_parallelism
