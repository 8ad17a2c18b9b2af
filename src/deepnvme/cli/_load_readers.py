"""The checkpoint readers ``deepnvme bench load`` compares, how each result is materialised,
and how the files are made cold (and checked to be) before each timed read.

Every reader's result is *touched*: one byte of every 4096 of each storage is summed (so a
lazy ``torch.load(mmap=True)`` faults every page in), or, with a CUDA device, every tensor is
copied there and the stream synchronised. The touch is part of the timed read.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import pickle
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import torch

from ..io.posix import evict_page_cache, resident_bytes
from ..memory.views import storage_bytes
from ._load_source import SAFETENSORS, TORCH, Checkpoint

__all__ = ["Reader", "READERS", "EVICTIONS", "missing_module", "read_errors", "read_checkpoint", "touch",
           "pick_eviction", "evict", "cache_state", "check_cold", "overall_cache"]

log = logging.getLogger(__name__)
DROP_CACHES = "/proc/sys/vm/drop_caches"
EVICTIONS = ("auto", "drop-caches", "fadvise", "none")
_PAGE = 4096


@dataclasses.dataclass(frozen=True)
class Reader:
    """One way to load a checkpoint file: ``call`` is how it is called (shown in the output),
    ``module`` must import for it to run, ``read(file, format)`` returns what it loaded."""

    name: str
    formats: frozenset[str]
    module: str
    call: str
    read: Callable[[str, str], Any]


def _deepnvme(fmt: str) -> Callable[..., Any]:
    import deepnvme
    return deepnvme.load_safetensors if fmt == SAFETENSORS else deepnvme.load


def _deepnvme_file(file: str, fmt: str) -> Any:
    return _deepnvme(fmt)(file)


def _deepnvme_mmap_file(file: str, fmt: str) -> Any:
    return _deepnvme(fmt)(file, mmap=True)


def _safetensors_file(file: str, fmt: str) -> Any:
    from safetensors.torch import load_file
    return load_file(file)


def _safe_open(file: str, fmt: str) -> Any:
    from safetensors import safe_open
    with safe_open(file, framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _torch_load(file: str, fmt: str) -> Any:
    return torch.load(file, map_location="cpu", weights_only=True)


def _torch_load_mmap(file: str, fmt: str) -> Any:
    return torch.load(file, map_location="cpu", weights_only=True, mmap=True)


_BOTH = frozenset((SAFETENSORS, TORCH))
READERS: dict[str, Reader] = {r.name: r for r in (
    Reader("deepnvme", _BOTH, "deepnvme", "deepnvme.load_safetensors / deepnvme.load",
           _deepnvme_file),
    Reader("deepnvme-mmap", _BOTH, "deepnvme", "deepnvme.load_safetensors / deepnvme.load (mmap=True)",
           _deepnvme_mmap_file),
    Reader("safetensors", frozenset((SAFETENSORS,)), "safetensors.torch",
           "safetensors.torch.load_file", _safetensors_file),
    Reader("safe_open", frozenset((SAFETENSORS,)), "safetensors", "safetensors.safe_open(pt)",
           _safe_open),
    Reader("torch.load", frozenset((TORCH,)), "torch", "torch.load(weights_only=True)",
           _torch_load),
    Reader("torch.load-mmap", frozenset((TORCH,)), "torch",
           "torch.load(mmap=True, weights_only=True)", _torch_load_mmap),
)}


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


def read_errors() -> tuple[type[BaseException], ...]:
    """What a reader raises on a file it cannot read (e.g. ``weights_only`` refusing a pickle,
    or ``torch.load`` handing a ``*.safetensors``-named zip to safetensors)."""
    errors: list[type[BaseException]] = [RuntimeError, ValueError, OSError, pickle.UnpicklingError]
    try:
        from safetensors import SafetensorError
    except ImportError:
        return tuple(errors)
    return (*errors, SafetensorError)


def read_checkpoint(reader: Reader, ckpt: Checkpoint) -> tuple[list[Any], str]:
    """Load every file of ``ckpt`` with ``reader``: the loaded objects and how it was called."""
    if reader.name.startswith("deepnvme"):  # one call, a file or a whole Hugging Face folder
        fn = _deepnvme(ckpt.format)
        mmap = reader.name == "deepnvme-mmap"
        notes = (["directory"] if ckpt.is_dir else []) + (["mmap=True"] if mmap else [])
        kind = f"({', '.join(notes)})" if notes else ""
        return [fn(ckpt.path if ckpt.is_dir else ckpt.files[0], mmap=mmap)], f"deepnvme.{fn.__name__}{kind}"
    return [reader.read(f, ckpt.format) for f in ckpt.files], reader.call


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in nested dicts, lists and tuples (a state dict, or a checkpoint of them)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def touch(objs: list[Any], device: str) -> int:
    """Materialise every tensor in ``objs``: on the CPU sum one byte per 4096 of each storage
    (once per storage), else copy it to ``device`` and synchronise; returns the tensor count."""
    count, seen, moved = 0, set(), []
    for t in (t for obj in objs for t in _tensors(obj)):
        count += 1
        if device != "cpu":
            moved.append(t.to(device))
            continue
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            storage_bytes(storage)[::_PAGE].sum()
    if device != "cpu":
        torch.cuda.synchronize()
    return count


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
