"""The safetensors header as pure bytes: builder, parser, dtype table and every malformed case."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from deepnvme.errors import CheckpointFormatError, DeepNVMeError
from deepnvme.formats import safetensors as safetensors_format
from deepnvme.formats.safetensors import (
    ALIGNMENT,
    DTYPES,
    MAX_HEADER,
    build_header,
    dtype_name,
    header_length,
    parse_header,
)

FILE = "bad.safetensors"


def _raw(header: object) -> bytes:
    return json.dumps(header).encode() if not isinstance(header, bytes) else header


def _parse(header: object, data_size: int):
    raw = _raw(header)
    return parse_header(raw, file=FILE, file_size=8 + len(raw) + data_size)


def _u8(n: int, begin: int = 0, end: int | None = None) -> dict:
    return {"dtype": "U8", "shape": [n], "data_offsets": [begin, begin + n if end is None else end]}


def test_error_class_is_a_value_error():
    assert issubclass(CheckpointFormatError, DeepNVMeError) and issubclass(CheckpointFormatError, ValueError)


def test_table_names_and_sizes():
    assert DTYPES["BF16"] is torch.bfloat16 and DTYPES["BOOL"] is torch.bool and DTYPES["C64"] is torch.complex64
    assert all(dtype_name(d) == name for name, d in DTYPES.items())
    with pytest.raises(TypeError, match="complex128"):
        dtype_name(torch.complex128)


def test_build_then_parse_gives_the_same_layout():
    specs = [("w", torch.bfloat16, (2, 3)), ("b", torch.float32, (3,)), ("s", torch.int64, ()),
             ("e", torch.uint8, (0, 5)), ("i", torch.int8, (7,))]
    head, layout = build_header(specs, {"format": "pt"})
    assert len(head) % ALIGNMENT == 0 and layout.data_start == len(head)
    assert header_length(head[:8], file=FILE, file_size=len(head) + layout.data_size) == len(head) - 8
    assert head.endswith(b" ")
    parsed = parse_header(head[8:], file=FILE, file_size=len(head) + layout.data_size)
    assert parsed == layout
    assert [(e.name, e.begin, e.end) for e in parsed.tensors.values()] == [
        ("w", 0, 12), ("b", 12, 24), ("s", 24, 32), ("e", 32, 32), ("i", 32, 39)]
    assert parsed.metadata == {"format": "pt"} and parsed.data_size == 39


def test_build_rejects_bad_names_metadata_and_dtypes():
    with pytest.raises(ValueError, match="reserved"):
        build_header([("__metadata__", torch.uint8, (1,))])
    with pytest.raises(ValueError, match="repeated"):
        build_header([("a", torch.uint8, (1,)), ("a", torch.uint8, (1,))])
    with pytest.raises(TypeError, match="str to str"):
        build_header([], {"a": 1})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="cannot be stored"):
        build_header([("a", torch.complex128, (1,))])


@pytest.mark.skipif(not hasattr(torch, "float4_e2m1fn_x2"), reason="this torch has no float4_e2m1fn_x2")
def test_f4_shape_counts_four_bit_values():
    f4 = torch.float4_e2m1fn_x2
    head, layout = build_header([("q", f4, (3, 5))])
    entry = json.loads(head[8:])["q"]
    assert entry == {"dtype": "F4", "shape": [3, 10], "data_offsets": [0, 15]}
    assert layout.tensors["q"].shape == (3, 5) and layout.tensors["q"].nbytes == 15
    parsed = parse_header(head[8:], file=FILE, file_size=len(head) + 15)
    assert parsed.tensors["q"].shape == (3, 5) and parsed.tensors["q"].dtype == f4
    with pytest.raises(ValueError, match="0-d"):
        build_header([("q", f4, ())])


def test_header_length_cases():
    assert header_length(struct.pack("<Q", 2), file=FILE, file_size=10) == 2
    with pytest.raises(CheckpointFormatError, match=f"{FILE}.*too short"):
        header_length(b"\x02\0\0", file=FILE, file_size=3)
    with pytest.raises(CheckpointFormatError, match=f"{FILE}.*past the end"):
        header_length(struct.pack("<Q", 100), file=FILE, file_size=50)
    # refused by the cap alone, whatever the file size: nothing past the 8 bytes is read
    with pytest.raises(CheckpointFormatError, match=f"{FILE}.*limit"):
        header_length(struct.pack("<Q", MAX_HEADER + 1), file=FILE, file_size=1 << 40)
    with pytest.raises(CheckpointFormatError, match="limit"):
        header_length(b"\xff" * 8, file=FILE, file_size=1 << 40)


def test_build_refuses_a_header_over_the_cap(monkeypatch):
    monkeypatch.setattr(safetensors_format, "MAX_HEADER", 4096)
    build_header([("a", torch.uint8, (1,))], {"k": "v" * 4000})
    with pytest.raises(ValueError, match="limit of 4096"):
        build_header([("a", torch.uint8, (1,))], {"k": "v" * 5000})


def test_parse_refuses_a_header_over_the_cap():
    raw = b"{}" + b" " * (MAX_HEADER - 1)
    with pytest.raises(CheckpointFormatError, match="limit"):
        parse_header(raw, file=FILE, file_size=8 + len(raw))


_NO_F4 = pytest.mark.skipif("F4" not in DTYPES, reason="this torch has no float4_e2m1fn_x2")


def _f4(case_id: str, header: dict, data_size: int, message: str):
    return pytest.param(header, data_size, message, id=case_id, marks=_NO_F4)


MALFORMED = [
    # (id, header, data_size, message fragment naming the field)
    ("end past data", {"a": _u8(4)}, 3, "out of range"),
    ("begin > end", {"a": {"dtype": "U8", "shape": [0], "data_offsets": [3, 2]}}, 3, "out of range"),
    ("overlap", {"a": _u8(4), "b": _u8(4, begin=2)}, 6, "overlaps"),
    ("hole", {"a": _u8(2), "b": _u8(2, begin=3)}, 5, "hole"),
    ("not from 0", {"a": _u8(2, begin=1)}, 3, "hole"),
    ("trailing bytes", {"a": _u8(2)}, 5, "cover 2 of the 5"),
    ("no tensors, some data", {}, 1, "cover 0 of the 1"),
    ("size vs shape", {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, "needs 96 bits"),
    ("size vs dtype", {"a": {"dtype": "F16", "shape": [4], "data_offsets": [0, 4]}}, 4, "F16 needs"),
    ("duplicate tensor", b'{"a":' + json.dumps(_u8(1)).encode() + b',"a":' + json.dumps(_u8(1)).encode() + b"}",
     1, "'a' appears twice"),
    ("duplicate field", b'{"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}}', 1,
     "'dtype' appears twice"),
    ("duplicate metadata", b'{"__metadata__":{"k":"1"},"__metadata__":{"k":"2"}}', 0, "__metadata__' appears twice"),
    ("not utf-8", b'{"\xff":' + json.dumps(_u8(1)).encode() + b"}", 1, "not UTF-8"),
    ("utf-16", json.dumps({"a": _u8(1)}).encode("utf-16"), 1, "not UTF-8"),
    ("not json", b"{nope", 0, "not valid JSON"),
    ("empty", b"", 0, "not valid JSON"),
    ("trailing nul", json.dumps({"a": _u8(1)}).encode() + b"\0", 1, "not valid JSON"),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000, 0, "not valid JSON"),
    ("huge integer", b'{"a":{"dtype":"U8","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,1]}}', 1, "JSON|shape"),
    ("list", [], 0, "not a JSON object"),
    ("string", "x", 0, "not a JSON object"),
    ("entry a list", {"a": [1, 2]}, 0, "'a'.*entry must be an object"),
    ("entry null", {"a": None}, 0, "'a'.*entry must be an object"),
    ("no dtype", {"a": {"shape": [1], "data_offsets": [0, 1]}}, 1, "entry must be an object with dtype"),
    ("no shape", {"a": {"dtype": "U8", "data_offsets": [0, 1]}}, 1, "entry must be"),
    ("no offsets", {"a": {"dtype": "U8", "shape": [1]}}, 1, "entry must be"),
    ("negative dim", {"a": {"dtype": "U8", "shape": [-1], "data_offsets": [0, 1]}}, 1, "'a'.*shape"),
    ("float dim", {"a": {"dtype": "U8", "shape": [1.0], "data_offsets": [0, 1]}}, 1, "shape"),
    ("bool dim", {"a": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, 1, "shape"),
    ("string dim", {"a": {"dtype": "U8", "shape": ["1"], "data_offsets": [0, 1]}}, 1, "shape"),
    ("shape not list", {"a": {"dtype": "U8", "shape": 1, "data_offsets": [0, 1]}}, 1, "shape"),
    ("NaN dim", b'{"a":{"dtype":"U8","shape":[NaN],"data_offsets":[0,1]}}', 1, "shape"),
    ("three offsets", {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1, 1]}}, 1, "data_offsets"),
    ("negative offset", {"a": {"dtype": "U8", "shape": [0], "data_offsets": [-1, -1]}}, 1, "data_offsets"),
    ("float offset", {"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1.0]}}, 1, "data_offsets"),
    ("unknown dtype", {"a": {"dtype": "Q4", "shape": [1], "data_offsets": [0, 1]}}, 1, "unknown dtype 'Q4'"),
    ("known to the package, not to torch", {"a": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}},
     3, "unknown dtype"),
    ("dtype not a string", {"a": {"dtype": 8, "shape": [1], "data_offsets": [0, 1]}}, 1, "unknown dtype"),
    ("lower-case dtype", {"a": {"dtype": "f32", "shape": [1], "data_offsets": [0, 4]}}, 4, "unknown dtype"),
    ("metadata not str", {"__metadata__": {"k": 1}}, 0, "__metadata__ must map str to str"),
    ("metadata a list", {"__metadata__": ["k"]}, 0, "__metadata__"),
]
_F4_MALFORMED = [
    _f4("F4 half byte", {"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, 2, "needs 12 bits"),
    _f4("F4 0-d", {"a": {"dtype": "F4", "shape": [], "data_offsets": [0, 1]}}, 1, "needs 4 bits"),
    _f4("F4 odd last dim", {"a": {"dtype": "F4", "shape": [2, 1], "data_offsets": [0, 1]}}, 1, "divisible by 2"),
]


@pytest.mark.parametrize("header, data_size, message",
                         [pytest.param(*case[1:], id=case[0]) for case in MALFORMED] + _F4_MALFORMED)
def test_malformed_headers_raise_naming_the_file(header, data_size, message):
    with pytest.raises(CheckpointFormatError, match=message) as info:
        _parse(header, data_size)
    assert FILE in str(info.value)


def test_header_longer_than_the_file():
    with pytest.raises(CheckpointFormatError, match=FILE):
        parse_header(b"{}" * 10, file=FILE, file_size=12)


@pytest.mark.parametrize("header, data_size", [
    pytest.param({"__metadata__": None, "a": _u8(1)}, 1, id="null metadata"),
    pytest.param(b'  {"a":' + json.dumps(_u8(1)).encode() + b"}\t\n  ", 1, id="whitespace around"),
    pytest.param({"a": {**_u8(1), "extra": [1]}}, 1, id="extra field"),
    pytest.param({"z": _u8(0), "a": _u8(2), "y": _u8(0, begin=2)}, 2, id="empty tensors share offsets"),
    pytest.param({}, 0, id="no tensors"),
    pytest.param({"a": _u8(1), "__metadata__": {"k": "v"}}, 1, id="metadata last"),
])
def test_what_the_package_accepts_is_accepted(header, data_size):
    parsed = _parse(header, data_size)
    assert sum(e.nbytes for e in parsed.tensors.values()) == data_size
    assert "__metadata__" not in parsed.tensors


def test_tensors_in_any_order_tile():
    parsed = _parse({"b": _u8(3, begin=2), "a": _u8(2)}, 5)
    assert list(parsed.tensors) == ["b", "a"]
    assert (parsed.tensors["a"].begin, parsed.tensors["b"].begin) == (0, 2)


_SPEC = st.tuples(st.sampled_from(sorted(n for n in DTYPES if n != "F4")),
                  st.lists(st.integers(0, 5), max_size=3))


@given(st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda s: s != "__metadata__"), _SPEC, max_size=6),
       st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
def test_build_parse_roundtrip_property(specs, metadata):
    head, layout = build_header([(k, DTYPES[d], tuple(s)) for k, (d, s) in specs.items()], metadata)
    assert parse_header(head[8:], file=FILE, file_size=len(head) + layout.data_size) == layout


_VALID, _VALID_LAYOUT = build_header([("a", torch.float32, (2, 3)), ("b", torch.int8, (5,))], {"k": "v"},
                                     alignment=8)


@given(st.lists(st.tuples(st.integers(0, len(_VALID) - 9), st.integers(0, 255)), min_size=1, max_size=4),
       st.integers(0, len(_VALID) - 8), st.integers(-3, 3))
def test_corrupted_headers_raise_only_checkpoint_format_error(flips, cut, size_delta):
    raw = bytearray(_VALID[8:])
    for pos, value in flips:
        raw[pos] = value
    raw = bytes(raw[:cut])
    try:
        parsed = parse_header(raw, file=FILE, file_size=8 + len(raw) + _VALID_LAYOUT.data_size + size_delta)
    except CheckpointFormatError:
        return
    for e in parsed.tensors.values():   # whatever parses stays inside the data section
        assert 0 <= e.begin <= e.end <= parsed.data_size
        assert e.nbytes == torch.Size(e.shape).numel() * e.dtype.itemsize
