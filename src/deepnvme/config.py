"""Settings: one table drives the environment variables, the defaults, the docs and validation.

Precedence, highest first: an explicit argument, a scoped :func:`override`, the environment
(``DEEPNVME_*``), the table's default. A handle snapshots its :class:`IOConfig` once, at
construction, so worker threads never read mutable process state.

Memory bound of one handle: bounce buffers, allocated only when a transfer's memory address is
not aligned for O_DIRECT: ``intra_op_parallelism x min(queue_depth, 4) x block_size`` bytes per
kernel mover in use (io_uring, aio: ``auto`` may use both), ``intra_op_parallelism x
block_size`` with ``threads``; plus the caller's own buffers.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import re
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .errors import ConfigError

__all__ = ["IOConfig", "Setting", "SETTINGS", "ENGINE_NAMES", "LOAD_PATHS", "resolve_config", "override",
           "CHECKPOINT_DEFAULTS", "checkpoint_config",
           "parse_size", "settings_markdown"]

log = logging.getLogger(__name__)

_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_MULT = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(value: str | int) -> int:
    """Parse ``4096``, ``"512K"``, ``"1M"``, ``"2GiB"`` into bytes (suffixes are binary: K = 1024)."""
    if isinstance(value, bool):
        raise ConfigError(f"expected a size, got the boolean {value!r}")
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ConfigError(f"cannot parse size {value!r}: use a number of bytes with an optional "
                          "K/M/G/T suffix (binary multiples), e.g. '1M'")
    return int(m.group(1)) * _SIZE_MULT[m.group(2).lower()]


def _parse_bool(value: str | bool) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"cannot parse boolean {value!r}: use 1/0, true/false, yes/no or on/off")


def _parse_int(value: str | int) -> int:
    return parse_size(value)


#: the I/O engines, fastest first; ``auto`` picks the first one this system can run
ENGINE_NAMES: tuple[str, ...] = ("io_uring", "aio", "threads")


def _parse_engine(value: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"expected an engine name, got {value!r}")
    name = value.strip().lower()
    if name not in ("auto",) + ENGINE_NAMES:
        raise ConfigError(f"unknown engine {value!r}; choose one of: auto, "
                          + ", ".join(ENGINE_NAMES))
    return name


#: how the loaders read a checkpoint: ``direct`` (the engine, O_DIRECT), ``mapped`` (a private
#: mapping populated through the page cache); ``auto`` measures the device on first use
LOAD_PATHS: tuple[str, ...] = ("direct", "mapped")


def _parse_load_path(value: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"expected a load path, got {value!r}")
    name = value.strip().lower()
    if name not in ("auto",) + LOAD_PATHS:
        raise ConfigError(f"unknown load path {value!r}; choose one of: auto, " + ", ".join(LOAD_PATHS))
    return name


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row of the settings table."""

    name: str
    env: str
    parse: Callable[[Any], Any]
    default: Any
    doc: str
    minimum: int | None = None


SETTINGS: tuple[Setting, ...] = (
    Setting("engine", "DEEPNVME_ENGINE", _parse_engine, "auto",
            "How chunks reach the kernel: `io_uring` or `aio` (Linux AIO) keep `queue_depth` "
            "chunks in flight per worker thread; `threads` issues one blocking syscall per "
            "worker. `auto` picks the first of io_uring, aio, threads that this system runs "
            "(logging once why it fell back); where io_uring and aio both run, it gives each "
            "request the one fast for it (io_uring for buffered transfers and, with one worker, "
            "file-extending writes, where Linux AIO is synchronous, and for large transfers of a "
            "page-locked buffer from its second use, which it registers once; aio for the rest), with "
            "worker threads per mover in use. `deepnvme report` lists which and why. A direct "
            "write past the file's end grows the file to its end first (fallocate), so it "
            "queues like an overwrite."),
    Setting("block_size", "DEEPNVME_BLOCK_SIZE", _parse_int, 1 << 20,
            "Bytes per chunk: a request is cut into chunks of this size (rounded down to the "
            "file's O_DIRECT alignment), each one syscall.", minimum=1),
    Setting("queue_depth", "DEEPNVME_QUEUE_DEPTH", _parse_int, 128,
            "Chunks in flight per worker thread with io_uring/aio (as DeepSpeed's); with "
            "`threads`, the most chunks handed to all workers at once. Further chunks wait in "
            "their request until a slot frees.", minimum=1),
    Setting("intra_op_parallelism", "DEEPNVME_INTRA_OP_PARALLELISM", _parse_int, 1,
            "Worker threads per handle; one request's chunks are spread across all of them.",
            minimum=1),
    Setting("single_submit", "DEEPNVME_SINGLE_SUBMIT", _parse_bool, False,
            "As DeepSpeed's: with io_uring/aio, submit chunks to the kernel one per call "
            "instead of in batches (slower; for devices that dislike deep batches). No effect "
            "with `threads`."),
    Setting("overlap_events", "DEEPNVME_OVERLAP_EVENTS", _parse_bool, False,
            "Accepted for DeepSpeed compatibility. Every engine already overlaps submitting "
            "new chunks with completing earlier ones, so it changes nothing (logged once)."),
    Setting("o_direct", "DEEPNVME_O_DIRECT", _parse_bool, True,
            "Open files with O_DIRECT (bypassing the page cache) where the filesystem accepts "
            "it; unaligned edges always go through a buffered descriptor."),
    Setting("alignment", "DEEPNVME_ALIGNMENT", _parse_int, 4096,
            "O_DIRECT alignment (bytes) assumed when the kernel cannot report the file's own "
            "(statx STATX_DIOALIGN), and the alignment of locked tensors and bounce buffers.",
            minimum=512),
    Setting("fsync", "DEEPNVME_FSYNC", _parse_bool, False,
            "fsync the file before a write request completes (durable writes). DeepSpeed's "
            "handles do not, hence off by default."),
    Setting("use_gds", "DEEPNVME_USE_GDS", _parse_bool, False,
            "Use GPUDirect Storage (cuFile) for CUDA tensors where available."),
    Setting("load_path", "DEEPNVME_LOAD_PATH", _parse_load_path, "auto",
            "How `load`, `load_safetensors`, `load_into` and `from_pretrained` read CPU tensors: "
            "`direct` (the engine, O_DIRECT), `mapped` (a private mapping of the file read in "
            "through the page cache by parallel `MADV_POPULATE_READ`; fresh loads return views of "
            "it). `auto` measures both on the file's device at first use and keeps the faster "
            "per device (see `deepnvme tune --load`)."),
)

_BY_NAME = {s.name: s for s in SETTINGS}
# DeepSpeed "aio" config keys that differ from ours.
_ALIASES = {"thread_count": "intra_op_parallelism"}


@dataclasses.dataclass(frozen=True)
class IOConfig:
    """A resolved, immutable snapshot of all settings (see :data:`SETTINGS` for each one's meaning)."""

    engine: str = "auto"
    block_size: int = 1 << 20
    queue_depth: int = 128
    intra_op_parallelism: int = 1
    single_submit: bool = False
    overlap_events: bool = False
    o_direct: bool = True
    alignment: int = 4096
    fsync: bool = False
    use_gds: bool = False
    load_path: str = "auto"

    def __post_init__(self) -> None:
        for s in SETTINGS:
            value = getattr(self, s.name)
            if s.parse is _parse_bool and not isinstance(value, bool):
                raise ConfigError(f"setting {s.name!r} must be a bool, got {value!r}")
            if s.parse is _parse_int:
                if isinstance(value, bool) or not isinstance(value, int):
                    raise ConfigError(f"setting {s.name!r} must be an int, got {value!r}")
                if s.minimum is not None and value < s.minimum:
                    raise ConfigError(f"setting {s.name!r} must be >= {s.minimum}, got {value}")
        if self.engine not in ("auto",) + ENGINE_NAMES:
            _parse_engine(self.engine)  # raises with the list of names
        if self.load_path not in ("auto",) + LOAD_PATHS:
            _parse_load_path(self.load_path)
        if self.alignment & (self.alignment - 1):
            raise ConfigError(f"setting 'alignment' must be a power of two, got {self.alignment}")

    def replace(self, **changes: Any) -> IOConfig:
        """Return a copy with some settings changed (validated like any other)."""
        return dataclasses.replace(self, **changes)

    def to_deepspeed(self) -> dict[str, dict[str, Any]]:
        """The DeepSpeed ``{"aio": {...}}`` section for these settings, with real key names."""
        keys = ("block_size", "queue_depth", "intra_op_parallelism", "single_submit",
                "overlap_events", "use_gds", "engine")
        return {"aio": {k: getattr(self, k) for k in keys}}

    @classmethod
    def from_deepspeed(cls, config: Mapping[str, Any]) -> IOConfig:
        """Build from a DeepSpeed ``"aio"`` dict (or a whole DeepSpeed config holding one).

        Unknown keys and wrongly typed values raise :class:`ConfigError` rather than being
        ignored; ``thread_count`` is accepted as the legacy name of ``intra_op_parallelism``.
        """
        section = config.get("aio", config) if isinstance(config, Mapping) else None
        if not isinstance(section, Mapping):
            raise ConfigError(f"expected a mapping for the 'aio' config, got {type(config).__name__}")
        explicit: dict[str, Any] = {}
        for key, value in section.items():
            name = _ALIASES.get(key, key)
            if name not in _BY_NAME:
                raise ConfigError(f"unknown 'aio' config key {key!r}; known keys: "
                                  f"{sorted(set(_BY_NAME) | set(_ALIASES))}")
            if name in explicit:
                raise ConfigError(f"'aio' config sets {name!r} twice (also as {key!r})")
            explicit[name] = value
        return resolve_config(explicit)


_NO_OVERRIDES: Mapping[str, Any] = types.MappingProxyType({})
_overrides: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "deepnvme_overrides", default=_NO_OVERRIDES)


@contextlib.contextmanager
def override(**settings: Any) -> Iterator[None]:
    """Scoped settings for configs resolved inside the ``with`` block (this thread/context only)."""
    for name in settings:
        if name not in _BY_NAME:
            raise ConfigError(f"unknown setting {name!r}; known: {sorted(_BY_NAME)}")
    token = _overrides.set({**_overrides.get(), **settings})
    try:
        yield
    finally:
        _overrides.reset(token)


def resolve_config(explicit: Mapping[str, Any] | IOConfig | None = None, *,
                   env: Mapping[str, str] | None = None) -> IOConfig:
    """Resolve every setting: explicit (non-None) > :func:`override` > environment > default."""
    if isinstance(explicit, IOConfig):
        return explicit
    explicit = dict(explicit or {})
    for name in explicit:
        if name not in _BY_NAME:
            raise ConfigError(f"unknown setting {name!r}; known: {sorted(_BY_NAME)}")
    environ = os.environ if env is None else env
    scoped = _overrides.get()
    values: dict[str, Any] = {}
    for s in SETTINGS:
        if explicit.get(s.name) is not None:
            raw, where = explicit[s.name], "argument"
        elif scoped.get(s.name) is not None:
            raw, where = scoped[s.name], "override"
        elif environ.get(s.env) not in (None, ""):
            raw, where = environ[s.env], f"environment variable {s.env}"
        else:
            values[s.name] = s.default
            continue
        if s.parse is _parse_bool and not isinstance(raw, (bool, str)):
            raise ConfigError(f"setting {s.name!r} from {where} must be a bool, got {raw!r}")
        if s.parse is _parse_bool and isinstance(raw, str) and where != f"environment variable {s.env}":
            raise ConfigError(f"setting {s.name!r} from {where} must be a JSON/Python bool, "
                              f"not the string {raw!r}")
        try:
            values[s.name] = s.parse(raw)
        except ConfigError as exc:
            raise ConfigError(f"setting {s.name!r} from {where}: {exc}") from None
    cfg = IOConfig(**values)
    if cfg.overlap_events:
        _note_no_effect("overlap_events")
    return cfg


_noted: set[str] = set()


CHECKPOINT_DEFAULTS: Mapping[str, int] = {"intra_op_parallelism": 4, "queue_depth": 32}
"""The checkpoint profile: settings the checkpoint features use where the resolved config
still has the library default."""


def checkpoint_config(config: IOConfig | Mapping[str, Any] | None) -> IOConfig:
    """Resolve ``config``; settings left at the library default take :data:`CHECKPOINT_DEFAULTS`.

    Checkpoints are large transfers: a few threads keep the disk busy while bounce-buffer
    copies (tensor memory is rarely O_DIRECT-aligned) run on another core.
    """
    if isinstance(config, IOConfig):
        return config
    cfg = resolve_config(config)
    base = IOConfig()
    given = dict(config or {})
    changes = {k: v for k, v in CHECKPOINT_DEFAULTS.items()
               if given.get(k) is None and getattr(cfg, k) == getattr(base, k)}
    return cfg.replace(**changes)


def _note_no_effect(name: str) -> None:
    if name not in _noted:
        _noted.add(name)
        log.info("deepnvme: %s=True is accepted for DeepSpeed compatibility but has no effect "
                 "(every engine overlaps submission and completion)", name)


def settings_markdown() -> str:
    """The settings table as Markdown (docs/settings.md embeds it; a test keeps the two equal)."""
    rows = ["| setting | environment variable | default | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        rows.append(f"| `{s.name}` | `{s.env}` | `{s.default}` | {s.doc} |")
    return "\n".join(rows)
