"""Which movers this system runs, and the one a config's ``engine`` setting selects.

Probing sets up and tears down one small kernel queue per engine, once per process (cached);
``auto`` takes the first available of :data:`~deepnvme.config.ENGINE_NAMES` and logs once
why it passed over the faster ones. An engine named explicitly that cannot run raises
:class:`~deepnvme.errors.ConfigError` with the reason. A mover that brings its own chunk call
(cuFile, :mod:`deepnvme.io.cufile`) is handed to the engine as a :class:`Mover` instead.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from typing import Protocol

from ..config import ENGINE_NAMES
from ..errors import ConfigError
from .aio import AioQueue, probe_aio
from .choice import KERNEL_MOVERS
from .kernel import KernelQueue
from .op import Op, Session
from .plan import Chunk
from .uring import UringQueue, probe_io_uring

__all__ = ["EngineProbe", "probe_engines", "select_engine", "select_movers", "queue_factory",
           "registers_buffers", "Mover"]

log = logging.getLogger(__name__)

_FACTORIES: dict[str, Callable[[int], KernelQueue]] = {"io_uring": UringQueue, "aio": AioQueue}
_PROBES: dict[str, Callable[[], str]] = {"io_uring": probe_io_uring, "aio": probe_aio}


class Mover(Protocol):
    """A mover given to :class:`~deepnvme.io.engine.Engine` (``mover=``) that issues chunks
    with its own call, one blocking call per worker thread; the engine keeps all coordination.

    Call order per request: the engine opens the descriptors and checks a read's range, plans
    plain ``block_size`` chunks (no host alignment planning: the memory may be on a device),
    then calls :meth:`open_session` (not for a request of 0 bytes); :meth:`run_chunk` per chunk
    on a worker thread; the session is closed with the descriptors. ``submit_many`` is refused.
    """

    #: the engine's name once this mover is in use (e.g. "cufile")
    name: str

    def open_session(self, op: Op) -> Session:
        """Per-request file state on the op's descriptor; raising fails the request."""
        ...

    def run_chunk(self, op: Op, chunk: Chunk) -> None:
        """Move one chunk; skip it if ``op.stopped``; record failures with ``op.fail``, never
        raise."""
        ...


@dataclasses.dataclass(frozen=True)
class EngineProbe:
    """Whether one engine runs here; ``detail`` says what it is, or why it cannot run."""

    name: str
    available: bool
    detail: str


def _why(exc: OSError) -> str:
    err = exc.errno or 0
    hint = {1: " (io_uring disabled: sysctl kernel.io_uring_disabled, or a seccomp filter)",
            38: " (the kernel lacks this system call)",
            12: " (memory locking limit: raise RLIMIT_MEMLOCK)",
            11: " (kernel limit reached, e.g. fs.aio-max-nr)"}.get(err, "")
    return f"{exc.strerror or os.strerror(err)} [errno {err}]{hint}"


@functools.cache
def _probe(name: str) -> EngineProbe:
    if name == "threads":
        return EngineProbe(name, True, "one blocking preadv/pwritev per worker thread")
    try:
        return EngineProbe(name, True, _PROBES[name]())
    except OSError as exc:
        return EngineProbe(name, False, _why(exc))


def probe_engines() -> tuple[EngineProbe, ...]:
    """One :class:`EngineProbe` per engine, fastest first (cached for the process)."""
    return tuple(_probe(name) for name in ENGINE_NAMES)


_fallback_logged: set[str] = set()


def select_engine(requested: str) -> str:
    """The engine to use for the setting ``requested`` (``auto`` or a name); see the module doc."""
    if requested != "auto":
        probe = _probe(requested)
        if not probe.available:
            raise ConfigError(f"engine {requested!r} is not available here: {probe.detail}; "
                              "use engine='auto' to pick the fastest that is")
        return requested
    passed: list[str] = []
    for probe in probe_engines():
        if probe.available:
            if passed and probe.name not in _fallback_logged:
                _fallback_logged.add(probe.name)
                log.warning("deepnvme: engine auto uses %s: %s", probe.name, "; ".join(passed))
            return probe.name
        passed.append(f"{probe.name} unavailable ({probe.detail})")
    raise ConfigError("no I/O engine is available")  # threads always is; kept for clarity


def select_movers(requested: str) -> tuple[str, ...]:
    """The movers an engine with the setting ``requested`` uses: the one named, or for
    ``auto`` every kernel mover that runs here when there are several (each transfer then
    goes to the one :func:`~deepnvme.io.choice.choose` names), else the one
    :func:`select_engine` picks. The first is the engine's name."""
    first = select_engine(requested)
    if requested != "auto" or first not in KERNEL_MOVERS:
        return (first,)
    kernel = tuple(p.name for p in probe_engines() if p.available and p.name in KERNEL_MOVERS)
    return (first,) + tuple(m for m in kernel if m != first)


def queue_factory(name: str) -> Callable[[int], KernelQueue] | None:
    """The kernel queue class of engine ``name``, or None for the thread mover."""
    return _FACTORIES.get(name)


@functools.cache
def registers_buffers() -> bool:
    """Whether io_uring here registers page-locked buffers (a sparse buffer table, Linux
    5.19+), so that a reused buffer's transfers skip pinning its pages (cached per process)."""
    try:
        q = UringQueue(1)
    except OSError:
        return False
    try:
        return bool(q.registers)
    finally:
        q.close()
