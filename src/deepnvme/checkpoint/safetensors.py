"""safetensors files with parallel O_DIRECT I/O, byte-compatible with the ``safetensors`` package.

Layout (the package's format): an 8-byte little-endian header length N, N bytes of JSON
(``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}``)
and the tensors' bytes packed back to back. deepnvme pads the JSON with spaces (as the
package does, to 8 bytes) up to a 4096-byte boundary, so the data starts O_DIRECT-aligned.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from typing import Any

import torch

from ..config import IOConfig, checkpoint_config
from ..errors import CheckpointFormatError
from ..handles.aio import AioHandle
from ..io import durable
from ..io.file import reserve
from ..io.plan import align_up
from ..memory.views import aligned_empty, storage_bytes
from ._paths import as_path

__all__ = ["save_safetensors", "load_safetensors"]

_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_ALIGN = 4096
_MAX_HEADER = 100_000_000


def _header(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
            ) -> tuple[bytes, list[tuple[torch.Tensor, int]]]:
    entries: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map str to str")
        entries["__metadata__"] = dict(metadata)
    seen: dict[tuple[int, int], str] = {}
    placed: list[tuple[str, torch.Tensor, int]] = []
    pos = 0
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise TypeError(f"save_safetensors takes a dict of str to tensor, got {name!r}: "
                            f"{type(t).__name__}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"tensor {name!r} has dtype {t.dtype}, which safetensors cannot store")
        if t.layout != torch.strided:
            raise TypeError(f"tensor {name!r} is {t.layout}; only dense tensors can be saved")
        if not t.is_contiguous():
            raise ValueError(f"tensor {name!r} is not contiguous; call .contiguous() first")
        nbytes = t.numel() * t.element_size()
        key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        if nbytes and key in seen:
            raise ValueError(f"tensors {seen[key]!r} and {name!r} share memory; safetensors "
                             "stores each tensor once: save a .clone() of one of them")
        seen[key] = name
        entries[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [pos, pos + nbytes]}
        placed.append((name, t, pos))
        pos += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    padded = align_up(8 + len(raw), _ALIGN) - 8
    raw += b" " * (padded - len(raw))
    start = 8 + len(raw)
    items = [(storage_bytes(t.untyped_storage())[t.storage_offset() * t.element_size():]
              [:t.numel() * t.element_size()].cpu(), start + off) for _, t, off in placed]
    return struct.pack("<Q", len(raw)) + raw, items


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike[str],
                     metadata: Mapping[str, str] | None = None, *,
                     config: IOConfig | Mapping[str, Any] | None = None) -> None:
    """Write ``tensors`` to a ``.safetensors`` file; blocks until it is durable (atomic replace).

    Readable by ``safetensors.torch.load_file``. Tensors must be contiguous and must not share
    memory (the package's rules); CUDA tensors are copied to the CPU first.
    """
    path = as_path(path, "deepnvme.save_safetensors")
    cfg = checkpoint_config(config)
    head, items = _header(tensors, metadata)
    header = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    size = len(head) + sum(t.numel() for t, _ in items)
    with durable.atomic_target(path) as tmp:
        reserve(tmp, size)
        with AioHandle(config=cfg) as handle:
            handle.write_many(tmp, [(header, 0), *items], fsync=True).result()


def _parse(path: str, f: Any, size: int) -> tuple[int, dict[str, Any], dict[str, str]]:
    raw = f.read(8)
    if len(raw) != 8:
        raise CheckpointFormatError(f"{path!r} is too short to be a safetensors file ({size} bytes)")
    (n,) = struct.unpack("<Q", raw)
    if n > _MAX_HEADER or 8 + n > size:
        raise CheckpointFormatError(f"{path!r}: header length {n} is impossible for a file of "
                                    f"{size} bytes (truncated or not a safetensors file)")
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointFormatError(f"{path!r}: corrupted safetensors header: {exc}") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path!r}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    return 8 + n, header, metadata


def _check_entry(path: str, name: str, e: Any, data_len: int) -> tuple[torch.dtype, list[int], int, int]:
    try:
        dtype = _NAMES[e["dtype"]]
        shape = [int(d) for d in e["shape"]]
        begin, end = (int(x) for x in e["data_offsets"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointFormatError(f"{path!r}: bad header entry for {name!r}: {exc!r}") from None
    numel = 1
    for d in shape:
        numel *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_len or end - begin != numel * itemsize:
        raise CheckpointFormatError(
            f"{path!r}: tensor {name!r} ({e['dtype']}, shape {shape}) has data_offsets "
            f"[{begin}, {end}] inconsistent with its size or the file's {data_len} data bytes "
            "(truncated or corrupted)")
    return dtype, shape, begin, end


def load_safetensors(path: str | os.PathLike[str], device: str | torch.device = "cpu", *,
                     config: IOConfig | Mapping[str, Any] | None = None) -> dict[str, torch.Tensor]:
    """Read a ``.safetensors`` file (the package's or ours) into a dict of tensors on ``device``.

    Blocks. Reads run in parallel with O_DIRECT into aligned CPU buffers, then move to
    ``device`` if it is not the CPU. Truncated or inconsistent files raise
    :class:`CheckpointFormatError`.
    """
    path = as_path(path, "deepnvme.load_safetensors")
    cfg = checkpoint_config(config)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        start, header, _ = _parse(path, f, size)
    entries = {name: _check_entry(path, name, e, size - start) for name, e in header.items()}
    spans = sorted((b, e) for _, _, b, e in entries.values())
    if spans and (spans[0][0] != 0 or any(a[1] != b[0] for a, b in zip(spans, spans[1:]))
                  or spans[-1][1] != size - start):
        raise CheckpointFormatError(f"{path!r}: tensor data does not tile the file's data "
                                    f"section of {size - start} bytes (truncated or corrupted)")
    out: dict[str, torch.Tensor] = {}
    items = []
    for name, (dtype, shape, begin, end) in entries.items():
        buf = aligned_empty(end - begin, start + begin)
        items.append((buf, start + begin))
        out[name] = buf.view(dtype).reshape(shape) if end > begin else torch.empty(shape, dtype=dtype)
    with AioHandle(config=cfg) as handle:
        handle.read_many(path, items).result()
    if torch.device(device).type != "cpu":
        out = {k: v.to(device) for k, v in out.items()}
    return out
