"""Megatron's .idx layout: round trips of encode_index/parse_index and malformed indexes (pure)."""

from __future__ import annotations

import struct

import pytest
import torch

from deepnvme.errors import DatasetFormatError
from deepnvme.formats.megatron_index import DTYPES, HEADER, MAGIC, dtype_by_name, encode_index, parse_index

U16 = dtype_by_name("uint16")


def _idx(lengths, documents=None, dtype=U16):
    lengths = torch.tensor(lengths, dtype=torch.int64)
    documents = torch.arange(len(lengths) + 1) if documents is None else torch.tensor(documents)
    return b"".join(encode_index(dtype, lengths, documents))


def _parse(data, bin_size=10**9):
    return parse_index(data, path="x.idx", bin_path="x.bin", bin_size=bin_size)


def test_layout_matches_the_documented_fields():
    data = _idx([3, 0, 5])
    magic, version, code, count, docs = HEADER.unpack_from(data, 0)
    assert (magic, version, code, count, docs) == (MAGIC, 1, 8, 3, 4)
    assert HEADER.size == 34 and len(data) == 34 + 3 * 4 + 3 * 8 + 4 * 8
    assert struct.unpack_from("<3i", data, 34) == (3, 0, 5)
    assert struct.unpack_from("<3q", data, 34 + 12) == (0, 6, 6)  # byte pointers, 2-byte tokens
    assert struct.unpack_from("<4q", data, 34 + 36) == (0, 1, 2, 3)


@pytest.mark.parametrize("code", sorted(DTYPES))
def test_round_trip_every_dtype(code):
    dtype = DTYPES[code]
    index = _parse(_idx([4, 1, 7], dtype=dtype))
    assert index.dtype == dtype and index.total_tokens == 12 and index.num_documents == 3
    assert index.pointers.tolist() == [0, 4 * dtype.itemsize, 5 * dtype.itemsize]
    assert index.document_bytes(2) == (5 * dtype.itemsize, 7 * dtype.itemsize)
    assert index.document_bytes(-1) == index.document_bytes(2)


def test_documents_of_several_sequences():
    index = _parse(_idx([2, 3, 4, 1], documents=[0, 2, 4]))
    assert index.num_documents == 2
    assert index.document_bytes(0) == (0, 10) and index.document_bytes(1) == (10, 10)
    with pytest.raises(IndexError, match="document 2 out of range"):
        index.document_bytes(2)


def test_empty_index():
    index = _parse(_idx([]), bin_size=0)
    assert index.total_tokens == 0 and index.num_documents == 0 and index.base == 0


def test_trailing_bytes_are_allowed():
    # a multimodal index carries one int8 mode per sequence after the document indices
    assert _parse(_idx([2, 2]) + b"\x00\x01").total_tokens == 4


@pytest.mark.parametrize("mutate, field", [
    (lambda d: b"MMIDIDY\x00\x00" + d[9:], "magic"),
    (lambda d: d[:9] + struct.pack("<Q", 2) + d[17:], "version"),
    (lambda d: d[:17] + bytes([9]) + d[18:], "dtype code"),
    (lambda d: d[:20], "header"),
    (lambda d: d[:-1], "size"),
    (lambda d: d[:34] + struct.pack("<i", -1) + d[38:], "sequence lengths"),
    (lambda d: d[:34 + 12 + 8] + struct.pack("<q", 7) + d[34 + 12 + 16:], "sequence pointers"),
    (lambda d: d[:34 + 36] + struct.pack("<q", 1) + d[34 + 44:], "document indices"),
    (lambda d: d[:-8] + struct.pack("<q", 2), "document indices"),
    (lambda d: d[:34 + 36 + 8] + struct.pack("<q", 3) + d[34 + 52:], "document indices"),
])
def test_malformed_index_names_file_and_field(mutate, field):
    with pytest.raises(DatasetFormatError, match=f"x.idx: {field}:"):
        _parse(mutate(_idx([3, 4, 5])))


def test_pointers_past_the_end_of_the_bin():
    data = _idx([3, 4, 5])
    _parse(data, bin_size=24)
    with pytest.raises(DatasetFormatError, match=r"sequence pointers: sequence 2 ends at byte 24 but x.bin "
                                                 r"holds 23 bytes"):
        _parse(data, bin_size=23)


def test_error_is_a_value_error():
    with pytest.raises(ValueError):
        _parse(b"nope")


def test_unknown_dtype_names():
    with pytest.raises(ValueError, match="cannot be stored"):
        dtype_by_name("bfloat16")
