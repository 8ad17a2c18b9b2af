"""The safetensors layout as pure data: one dtype table, one header builder, one header parser.

A file is an 8-byte little-endian header length N, N bytes of UTF-8 JSON
(``{"__metadata__": {str: str}, name: {"dtype", "shape", "data_offsets": [begin, end]}}``,
offsets relative to byte 8 + N) and the tensors' bytes, which must tile the rest of the file
exactly (the package's rule). ``F4`` packs two 4-bit values per byte: the file's shape counts
4-bit values, torch's ``float4_e2m1fn_x2`` counts bytes, so its last dimension is half the
file's. Nothing here moves tensor bytes; :func:`read_header` reads only the header.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from ..errors import CheckpointFormatError
from .torchzip import ZIP_MAGIC

__all__ = ["ALIGNMENT", "MAX_HEADER", "DTYPES", "TensorEntry", "SafetensorsHeader", "dtype_name",
           "build_header", "header_length", "parse_header", "read_header", "StoredTensor", "locate"]

ALIGNMENT = 4096
"""Alignment (bytes) of the data section in files deepnvme writes, so reads can use O_DIRECT."""

MAX_HEADER = 100_000_000
"""Largest JSON header (bytes) accepted, the safetensors package's own limit."""

# (safetensors name, torch attribute, bits per element in the file). Rows whose torch dtype is
# absent from the running torch are left out of DTYPES.
_TABLE: tuple[tuple[str, str, int], ...] = (
    ("BOOL", "bool", 8), ("U8", "uint8", 8), ("I8", "int8", 8), ("U16", "uint16", 16),
    ("I16", "int16", 16), ("U32", "uint32", 32), ("I32", "int32", 32), ("U64", "uint64", 64),
    ("I64", "int64", 64), ("F16", "float16", 16), ("BF16", "bfloat16", 16), ("F32", "float32", 32),
    ("F64", "float64", 64), ("C64", "complex64", 64), ("F8_E4M3", "float8_e4m3fn", 8),
    ("F8_E5M2", "float8_e5m2", 8), ("F8_E4M3FNUZ", "float8_e4m3fnuz", 8),
    ("F8_E5M2FNUZ", "float8_e5m2fnuz", 8), ("F8_E8M0", "float8_e8m0fnu", 8),
    ("F4", "float4_e2m1fn_x2", 4),
)
_BITS: dict[str, int] = {name: bits for name, _, bits in _TABLE}
DTYPES: Mapping[str, torch.dtype] = types.MappingProxyType({
    name: getattr(torch, attr) for name, attr, _ in _TABLE if isinstance(getattr(torch, attr, None), torch.dtype)})
"""safetensors dtype name -> torch dtype, for every name this torch can represent."""
_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
_LENGTH = struct.Struct("<Q")
_ENTRY_KEYS = ("dtype", "shape", "data_offsets")


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One tensor: torch ``dtype`` and ``shape``, bytes ``[begin, end)`` of the data section."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclasses.dataclass(frozen=True)
class SafetensorsHeader:
    """A parsed (or built) header: tensors in header order; data starts at byte ``data_start``."""

    tensors: Mapping[str, TensorEntry]
    metadata: Mapping[str, str]
    data_start: int
    data_size: int


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of ``dtype``; ``TypeError`` if safetensors cannot store it."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} cannot be stored in safetensors; supported: "
                        f"{sorted(str(d) for d in _NAMES)}") from None


def _file_shape(name: str, dtype: torch.dtype, shape: Sequence[int]) -> list[int]:
    per = dtype.itemsize * 8 // _BITS[dtype_name(dtype)]
    if per == 1:
        return list(shape)
    if not shape:
        raise ValueError(f"tensor {name!r}: a 0-d {dtype} tensor has no safetensors shape "
                         f"({per} packed values per element); reshape it to (1,)")
    return [*shape[:-1], shape[-1] * per]


def build_header(tensors: Iterable[tuple[str, torch.dtype, Sequence[int]]],
                 metadata: Mapping[str, str] | None = None, *,
                 alignment: int = ALIGNMENT) -> tuple[bytes, SafetensorsHeader]:
    """The file's first bytes (length, JSON, space padding to ``alignment``) for tensors packed
    back to back in the given order, with the layout they describe."""
    entries: dict[str, Any] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("safetensors metadata must map str to str")
        entries["__metadata__"] = dict(metadata)
    layout: dict[str, TensorEntry] = {}
    pos = 0
    for name, dtype, shape in tensors:
        if not isinstance(name, str) or name == "__metadata__" or name in layout:
            raise ValueError(f"tensor name {name!r} is not a str, is reserved or is repeated")
        file_shape = _file_shape(name, dtype, shape)
        nbytes = math.prod(shape) * dtype.itemsize
        entries[name] = {"dtype": dtype_name(dtype), "shape": file_shape, "data_offsets": [pos, pos + nbytes]}
        layout[name] = TensorEntry(name, dtype, tuple(shape), pos, pos + nbytes)
        pos += nbytes
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % alignment)
    if len(raw) > MAX_HEADER:
        raise ValueError(f"the safetensors header would take {len(raw)} bytes, past the format's limit of "
                         f"{MAX_HEADER}: save fewer tensors or less metadata per file")
    return _LENGTH.pack(len(raw)) + raw, SafetensorsHeader(layout, dict(metadata or {}), 8 + len(raw), pos)


def header_length(prefix: bytes, *, file: str, file_size: int) -> int:
    """The JSON length N from the file's first 8 bytes, checked against the cap and ``file_size``."""
    if len(prefix) < 8 or file_size < 8:
        raise CheckpointFormatError(f"{file!r}: too short for a safetensors file ({file_size} bytes; "
                                    "the header length alone takes 8)")
    (n,) = _LENGTH.unpack_from(prefix)
    hint = ("; it is a zip file, as torch.save writes: read it with deepnvme.load"
            if prefix.startswith(ZIP_MAGIC) else "")
    if n > MAX_HEADER:
        raise CheckpointFormatError(f"{file!r}: header length {n} exceeds the safetensors limit of "
                                    f"{MAX_HEADER} bytes (corrupted or not a safetensors file){hint}")
    if 8 + n > file_size:
        raise CheckpointFormatError(f"{file!r}: header length {n} runs past the end of the file "
                                    f"({file_size} bytes; truncated or not a safetensors file){hint}")
    return int(n)


def _no_duplicates(file: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise CheckpointFormatError(f"{file!r}: key {key!r} appears twice in the safetensors header")
            out[key] = value
        return out
    return hook


def _is_uint(x: object) -> bool:
    return type(x) is int and x >= 0


def _entry(file: str, name: str, info: object, data_size: int) -> TensorEntry:
    where = f"{file!r}: tensor {name!r}"
    if not isinstance(info, dict) or any(k not in info for k in _ENTRY_KEYS):
        raise CheckpointFormatError(f"{where}: entry must be an object with {', '.join(_ENTRY_KEYS)}; "
                                    f"got {str(info)[:200]}")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or code not in DTYPES:
        raise CheckpointFormatError(f"{where}: unknown dtype {str(code)[:50]!r}; this torch reads "
                                    f"{sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(_is_uint(d) for d in shape):
        raise CheckpointFormatError(f"{where}: shape must be a list of non-negative integers, got "
                                    f"{str(shape)[:200]}")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_uint(x) for x in offsets):
        raise CheckpointFormatError(f"{where}: data_offsets must be two non-negative integers, got "
                                    f"{str(offsets)[:200]}")
    begin, end = offsets
    if begin > end or end > data_size:
        raise CheckpointFormatError(f"{where}: data_offsets [{begin}, {end}] out of range of the "
                                    f"{data_size}-byte data section (truncated or corrupted)")
    bits = math.prod(shape) * _BITS[code]
    if bits % 8 or bits // 8 != end - begin:
        raise CheckpointFormatError(f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, "
                                    f"but shape {shape} x {code} needs {bits} bits")
    dtype = DTYPES[code]
    per = dtype.itemsize * 8 // _BITS[code]
    if per > 1 and (not shape or shape[-1] % per):
        raise CheckpointFormatError(f"{where}: shape {shape} x {code} has a last dimension not divisible "
                                    f"by {per}, so torch cannot view it as {dtype}")
    torch_shape = tuple(shape[:-1]) + (shape[-1] // per,) if per > 1 else tuple(shape)
    return TensorEntry(name, dtype, torch_shape, begin, end)


def _check_tiling(file: str, entries: Iterable[TensorEntry], data_size: int) -> None:
    pos, last = 0, None
    for e in sorted(entries, key=lambda e: (e.begin, e.end)):
        if e.begin != pos:
            kind = "overlaps" if e.begin < pos else "leaves a hole before"
            raise CheckpointFormatError(f"{file!r}: tensor {e.name!r} data_offsets [{e.begin}, {e.end}] "
                                        f"{kind} the data ending at {pos}" + (f" ({last!r})" if last else ""))
        pos, last = e.end, e.name
    if pos != data_size:
        raise CheckpointFormatError(f"{file!r}: tensors cover {pos} of the {data_size}-byte data "
                                    "section (trailing bytes, or a truncated or corrupted header)")


def parse_header(raw: bytes, *, file: str, file_size: int) -> SafetensorsHeader:
    """Parse and validate the JSON header ``raw`` (without its 8-byte length) of a file of
    ``file_size`` bytes; any inconsistency raises :class:`CheckpointFormatError` naming ``file``."""
    data_size = file_size - 8 - len(raw)
    if len(raw) > MAX_HEADER or data_size < 0:
        raise CheckpointFormatError(f"{file!r}: a {len(raw)}-byte header does not fit the limit of "
                                    f"{MAX_HEADER} bytes or the file's {file_size} bytes")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates(file))
    except UnicodeDecodeError as exc:
        raise CheckpointFormatError(f"{file!r}: safetensors header is not UTF-8 ({exc})") from None
    except (ValueError, RecursionError) as exc:   # JSONDecodeError, too-long integers, deep nesting
        if isinstance(exc, CheckpointFormatError):
            raise
        raise CheckpointFormatError(f"{file!r}: safetensors header is not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{file!r}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointFormatError(f"{file!r}: __metadata__ must map str to str, got {str(metadata)[:200]}")
    tensors = {name: _entry(file, name, info, data_size) for name, info in header.items()}
    _check_tiling(file, tensors.values(), data_size)
    return SafetensorsHeader(tensors, metadata, 8 + len(raw), data_size)


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and parse the header of the safetensors file at ``path`` (blocking; no tensor data)."""
    file = os.fspath(path)
    with open(file, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        n = header_length(f.read(8), file=file, file_size=size)
        raw = f.read(n)
    if len(raw) != n:
        raise CheckpointFormatError(f"{file!r}: file shrank while its {n}-byte header was read")
    return parse_header(raw, file=file, file_size=size)


@dataclasses.dataclass(frozen=True)
class StoredTensor:
    """Bytes ``[offset, offset + nbytes)`` of ``file`` hold tensor ``name``: row-major when
    ``stride`` is None, else a strided view starting at the first of those bytes. The
    checkpoint loaders and the inference streamer plan their reads from these."""

    name: str
    file: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...] | None = None


def locate(header: SafetensorsHeader, file: str) -> dict[str, StoredTensor]:
    """The tensors of ``header`` (parsed from ``file``) with absolute offsets in that file."""
    return {name: StoredTensor(name, file, header.data_start + e.begin, e.nbytes, e.dtype, e.shape)
            for name, e in header.tensors.items()}
