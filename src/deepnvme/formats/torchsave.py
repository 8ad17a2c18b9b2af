"""The tensors of a torch.save zip file: file, byte range, dtype, shape and stride (no data read).

The zip's storage records are located by :mod:`deepnvme.formats.torchzip`; ``data.pkl`` is
unpickled by PyTorch's own loader and ``weights_only`` unpickler with every storage replaced by a
``meta`` stand-in, so the result gives each tensor's storage, dtype, shape, stride and offset
without allocating data.
"""

from __future__ import annotations

import math
import os
import pickle
import sys
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import CheckpointFormatError, DeepNVMeIOError
from .safetensors import StoredTensor
from .torchzip import ZIP_MAGIC, RecordSpan, read_record_spans, storage_spans

__all__ = ["torch_skeleton", "torch_layout"]


class _MetaReader:
    """Wraps ``torch._C.PyTorchFileReader``: each storage record becomes a ``meta`` tensor whose
    storage identity tells which record a rebuilt tensor views."""

    def __init__(self, reader: Any, spans: Mapping[str, RecordSpan], path: str) -> None:
        self._reader = reader
        self._spans = spans
        self._path = path
        self.keys: dict[int, str] = {}
        self._keep: list[torch.Tensor] = []   # keeps storage identities unique while unpickling

    def get_storage_from_record(self, name: str, numel: int, dtype: Any) -> torch.Tensor:
        key = name[5:] if name.startswith("data/") else ""
        span = self._spans.get(key)
        if span is None or span.size != numel:
            have = "no such record" if span is None else f"a record of {span.size} bytes"
            raise CheckpointFormatError(f"{self._path!r}: the pickle wants storage {name!r} of "
                                        f"{numel} bytes; the archive has {have}")
        stub = torch.empty(numel, dtype=torch.uint8, device="meta")
        self.keys[stub.untyped_storage()._cdata] = key
        self._keep.append(stub)
        return stub

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reader, name)


def _unpickle(path: str, spans: Mapping[str, RecordSpan], byteorder: bool) -> tuple[Any, dict[int, str]]:
    ser = torch.serialization
    try:
        reader = torch._C.PyTorchFileReader(path)
        if byteorder and bytes(reader.get_record("byteorder")).decode() != sys.byteorder:
            raise CheckpointFormatError(f"{path!r} was saved on a machine of the other byte order: "
                                        "load it with torch.load, which swaps the bytes")
        meta = _MetaReader(reader, spans, path)
        unpickler = ser._weights_only_unpickler  # type: ignore[attr-defined]  # torch's own, private
        obj = ser._load(meta, lambda storage, location: storage, unpickler, encoding="utf-8")
    except CheckpointFormatError:
        raise
    except pickle.UnpicklingError as exc:
        raise CheckpointFormatError(f"{path!r}: refused by the weights_only unpickler: {exc}") from None
    except (RuntimeError, ValueError, TypeError, KeyError, EOFError, AttributeError,
            IndexError, UnicodeDecodeError) as exc:
        raise CheckpointFormatError(f"{path!r}: data.pkl cannot be read: {exc}") from None
    return obj, meta.keys


def torch_skeleton(path: str) -> tuple[Any, dict[int, str], dict[str, RecordSpan]]:
    """A torch.save file's object with ``meta`` tensors in place of data, each meta storage's
    record key (by ``UntypedStorage._cdata``), and the storage records' spans; no data read."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic != ZIP_MAGIC:
                raise CheckpointFormatError(f"{path!r} is not a torch.save zip file (empty, legacy "
                                            "pre-1.6 format or another format): re-save it with torch.save")
            all_spans = read_record_spans(f, path=path, file_size=os.fstat(f.fileno()).st_size)
    except FileNotFoundError as exc:
        raise DeepNVMeIOError.from_oserror(exc, op="open for load", path=path, offset=0,
                                           size=0) from None
    spans = storage_spans(all_spans)
    obj, keys = _unpickle(path, spans, "byteorder" in all_spans)
    return obj, keys, spans


def torch_layout(path: str) -> dict[str, StoredTensor]:
    """The tensors of a torch.save file holding a flat dict of name -> tensor (a state dict)."""
    obj, keys, spans = torch_skeleton(path)
    if not isinstance(obj, dict):
        raise CheckpointFormatError(f"{path!r} holds a {type(obj).__name__}, not a state dict "
                                    "(a dict of name -> tensor)")
    out: dict[str, StoredTensor] = {}
    for name, t in obj.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise CheckpointFormatError(f"{path!r}: entry {name!r} is a {type(t).__name__}; a state "
                                        "dict maps str to tensors only")
        key = keys.get(t.untyped_storage()._cdata)
        if key is None:
            raise CheckpointFormatError(f"{path!r}: tensor {name!r} has no storage record")
        out[name] = _stored(path, name, t, spans[key])
    return out


def _stored(path: str, name: str, t: torch.Tensor, span: RecordSpan) -> StoredTensor:
    size = t.element_size()
    shape, stride = tuple(t.shape), tuple(t.stride())
    if t.numel() == 0:
        return StoredTensor(name, path, span.offset, 0, t.dtype, shape)
    if t.layout != torch.strided or min(stride, default=0) < 0:
        raise CheckpointFormatError(f"{path!r}: tensor {name!r} is not a dense strided tensor")
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride))
    start = int(t.storage_offset()) * size
    if start + extent * size > span.size:
        raise CheckpointFormatError(f"{path!r}: tensor {name!r} reaches past the end of its "
                                    f"{span.size}-byte storage record")
    contiguous = t.is_contiguous()
    nbytes = math.prod(shape) * size if contiguous else extent * size
    return StoredTensor(name, path, span.offset + start, nbytes, t.dtype, shape,
                        None if contiguous else stride)
