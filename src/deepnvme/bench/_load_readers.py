"""The checkpoint readers ``deepnvme bench load`` compares and how each result is materialised
(making the files cold first is :mod:`deepnvme.bench._reading`'s).

Every reader's result is *touched*: one byte of every 4096 of each storage is summed (so a
lazy ``torch.load(mmap=True)`` faults every page in), or, with a CUDA device, every tensor is
copied there and the stream synchronised. The touch is part of the timed read.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..memory.views import storage_bytes
from ._load_source import SAFETENSORS, TORCH, Checkpoint

__all__ = ["Reader", "READERS", "read_errors", "read_checkpoint", "touch"]

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
