"""Megatron's indexed dataset: the ``.idx`` layout next to a ``.bin`` of concatenated tokens.

Layout (little-endian), as megatron-core's ``IndexedDatasetBuilder`` writes it: 9 magic bytes
``MMIDIDX\\0\\0``, u64 version (1), u8 dtype code, u64 sequence count S, u64 document count D,
then S int32 sequence lengths (tokens), S int64 sequence pointers (byte offsets in the .bin),
D int64 document indices (sequence index where each document starts, the last one S); a
multimodal index adds S int8 modes after them, which are not read here. Pure: parses and
builds bytes, opens no files. Arrays are torch tensors, so NumPy is not needed.
"""

from __future__ import annotations

import dataclasses
import struct

import torch

from ..errors import DatasetFormatError
from ..memory.views import byte_view

__all__ = ["MAGIC", "VERSION", "DTYPES", "HEADER", "TokenDType", "TokenIndex", "dtype_by_name",
           "parse_index", "encode_index"]

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequence count, document count


@dataclasses.dataclass(frozen=True)
class TokenDType:
    """One token dtype of the format: its code in the .idx, NumPy name, torch dtype, bytes."""

    code: int
    name: str
    torch_dtype: torch.dtype
    itemsize: int


DTYPES: dict[int, TokenDType] = {d.code: d for d in (
    TokenDType(1, "uint8", torch.uint8, 1),
    TokenDType(2, "int8", torch.int8, 1),
    TokenDType(3, "int16", torch.int16, 2),
    TokenDType(4, "int32", torch.int32, 4),
    TokenDType(5, "int64", torch.int64, 8),
    TokenDType(6, "float64", torch.float64, 8),
    TokenDType(7, "float32", torch.float32, 4),
    TokenDType(8, "uint16", torch.uint16, 2),
)}


def dtype_by_name(name: str) -> TokenDType:
    """The format's dtype called ``name`` (NumPy's spelling); ValueError listing the choices."""
    for d in DTYPES.values():
        if d.name == name:
            return d
    raise ValueError(f"dtype {name!r} cannot be stored in a Megatron indexed dataset; choose one of "
                     f"{', '.join(d.name for d in DTYPES.values())}")


@dataclasses.dataclass(frozen=True)
class TokenIndex:
    """A parsed and checked ``.idx``: ``lengths`` (int32, tokens per sequence), ``pointers``
    (int64, byte offset of each sequence in the .bin), ``documents`` (int64, D entries: the
    sequence where each document starts, the last one the sequence count). The sequences lie
    back to back from ``pointers[0]`` (:func:`parse_index` checks it), so the .bin bytes
    ``[base, base + total_tokens x itemsize)`` are the concatenation of every document."""

    dtype: TokenDType
    lengths: torch.Tensor
    pointers: torch.Tensor
    documents: torch.Tensor
    total_tokens: int

    @property
    def base(self) -> int:
        """Byte offset of the first token in the .bin."""
        return int(self.pointers[0]) if len(self.pointers) else 0

    @property
    def num_documents(self) -> int:
        return max(len(self.documents) - 1, 0)

    def document_bytes(self, j: int) -> tuple[int, int]:
        """``(offset, nbytes)`` of document ``j`` in the .bin (IndexError when out of range)."""
        n = self.num_documents
        if not -n <= j < n:
            raise IndexError(f"document {j} out of range: the dataset has {n} documents")
        j %= n
        first, stop = int(self.documents[j]), int(self.documents[j + 1])
        return self._seq_start(first), self._seq_start(stop) - self._seq_start(first)

    def _seq_start(self, k: int) -> int:
        """Byte offset of sequence ``k`` (the end of the data for ``k`` = sequence count)."""
        if k < len(self.pointers):
            return int(self.pointers[k])
        return self.base + self.total_tokens * self.dtype.itemsize


def _fail(path: str, field: str, why: str) -> DatasetFormatError:
    return DatasetFormatError(f"{path}: {field}: {why}")


def parse_index(data: bytes | bytearray | memoryview, *, path: str, bin_path: str, bin_size: int
                ) -> TokenIndex:
    """Parse and check the bytes of ``path`` (an .idx) against the size of its .bin.

    Raises :class:`~deepnvme.errors.DatasetFormatError` naming the file and field for a bad
    magic or version, an unknown dtype code, a truncated file, negative lengths, document
    indices that are not ascending from 0 to the sequence count, pointers that are not back to
    back, and sequences past the end of the .bin.
    """
    view = memoryview(data).cast("B")
    if len(view) < HEADER.size:
        raise _fail(path, "header", f"the file holds {len(view)} bytes, fewer than the "
                    f"{HEADER.size}-byte header (truncated, or not an .idx file)")
    magic, version, code, count, docs = HEADER.unpack_from(view, 0)
    if magic != MAGIC:
        raise _fail(path, "magic", f"expected {MAGIC!r}, found {bytes(magic)!r}: not a Megatron "
                    "indexed dataset index")
    if version != VERSION:
        raise _fail(path, "version", f"expected {VERSION}, found {version}")
    if code not in DTYPES:
        raise _fail(path, "dtype code", f"unknown code {code}; known: "
                    + ", ".join(f"{c} ({d.name})" for c, d in DTYPES.items()))
    need = HEADER.size + 12 * count + 8 * docs
    if len(view) < need:
        raise _fail(path, "size", f"{count} sequences and {docs} document indices need {need} "
                    f"bytes, the file holds {len(view)} (truncated)")
    dtype = DTYPES[code]
    buf = bytearray(view[HEADER.size:need])
    lengths = torch.frombuffer(buf, dtype=torch.int32, count=count) if count else torch.empty(0, dtype=torch.int32)
    pointers = (torch.frombuffer(buf, dtype=torch.int64, count=count, offset=4 * count) if count
                else torch.empty(0, dtype=torch.int64))
    documents = (torch.frombuffer(buf, dtype=torch.int64, count=docs, offset=12 * count) if docs
                 else torch.empty(0, dtype=torch.int64))
    total = _check_arrays(dtype, lengths, pointers, documents, path)
    ends = pointers + lengths.to(torch.int64) * dtype.itemsize
    past = (ends > bin_size).nonzero()
    if len(past):
        k = int(past[0])
        raise _fail(path, "sequence pointers", f"sequence {k} ends at byte {int(ends[k])} but {bin_path} "
                    f"holds {bin_size} bytes (pointers past the end of the .bin: a truncated .bin, or "
                    "an .idx of another file)")
    return TokenIndex(dtype=dtype, lengths=lengths, pointers=pointers, documents=documents,
                      total_tokens=total)


def _check_arrays(dtype: TokenDType, lengths: torch.Tensor, pointers: torch.Tensor,
                  documents: torch.Tensor, path: str) -> int:
    """Check the three arrays against each other; the total token count."""
    count = len(lengths)
    if count and bool((lengths < 0).any()):
        k = int((lengths < 0).nonzero()[0])
        raise _fail(path, "sequence lengths", f"sequence {k} has negative length {int(lengths[k])}")
    if not len(documents) or int(documents[0]) != 0 or int(documents[-1]) != count:
        found = documents.tolist() if len(documents) <= 4 else f"[{int(documents[0])}, ..., {int(documents[-1])}]"
        raise _fail(path, "document indices", f"must run from 0 to the sequence count {count}, found {found}")
    if len(documents) > 1 and bool((documents[1:] < documents[:-1]).any()):
        k = int((documents[1:] < documents[:-1]).nonzero()[0]) + 1
        raise _fail(path, "document indices", f"entry {k} ({int(documents[k])}) is below entry {k - 1}")
    if not count:
        return 0
    sizes = lengths.to(torch.int64) * dtype.itemsize
    base = int(pointers[0])
    if base < 0 or base % dtype.itemsize:
        raise _fail(path, "sequence pointers", f"sequence 0 starts at byte {base}, not a "
                    f"non-negative multiple of the {dtype.itemsize}-byte token size")
    expected = base + torch.cumsum(sizes, 0)[:-1]
    bad = (pointers[1:] != expected).nonzero()
    if len(bad):
        k = int(bad[0]) + 1
        raise _fail(path, "sequence pointers", f"sequence {k} starts at byte {int(pointers[k])}, expected "
                    f"{int(expected[k - 1])} (right after sequence {k - 1}); the sequences must lie back "
                    "to back in the .bin, as megatron-core's builder writes them")
    return int(lengths.to(torch.int64).sum())


def encode_index(dtype: TokenDType, lengths: torch.Tensor, documents: torch.Tensor) -> list[bytes]:
    """The .idx bytes (in pieces, to write one after the other) for sequences of ``lengths``
    (int64 tokens each, back to back from byte 0) grouped by ``documents`` (int64, starting at
    0 and ending at the sequence count)."""
    lengths = lengths.to(torch.int64)
    count = len(lengths)
    pointers = torch.zeros(count, dtype=torch.int64)
    if count > 1:
        torch.cumsum(lengths[:-1] * dtype.itemsize, 0, out=pointers[1:])
    header = HEADER.pack(MAGIC, VERSION, dtype.code, count, len(documents))
    return [header, _le_bytes(lengths.to(torch.int32)), _le_bytes(pointers), _le_bytes(documents.to(torch.int64))]


def _le_bytes(tensor: torch.Tensor) -> bytes:
    """A CPU tensor's bytes (little-endian: the host order on every platform torch ships for)."""
    return bytes(byte_view(tensor.contiguous()))
