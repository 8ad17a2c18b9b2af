"""Every dtype the safetensors package maps, both ways, with random bytes; malformed files on disk."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import deepnvme
from deepnvme.errors import CheckpointFormatError
from deepnvme.formats.safetensors import MAX_HEADER, read_header
from deepnvme.inference._safetensors import read_checkpoint_index

# safetensors name -> torch attribute, as the package maps them (stated here, not imported
# from deepnvme, so a wrong row in deepnvme's table fails).
PACKAGE_DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu", "F4": "float4_e2m1fn_x2",
}


def _dtype(name: str) -> torch.dtype:
    attr = PACKAGE_DTYPES[name]
    if not isinstance(getattr(torch, attr, None), torch.dtype):
        pytest.skip(f"this torch has no torch.{attr}")
    return getattr(torch, attr)


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), dtype=torch.uint8, generator=g)
    return raw.view(dtype)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"x": _random(dtype, (5, 6), 1), "y": _random(dtype, (1000,), 2),
            "empty": torch.empty((0, 4), dtype=dtype)}


@pytest.mark.parametrize("name", sorted(PACKAGE_DTYPES))
def test_package_reads_what_we_write(tmp_path, name):
    dtype = _dtype(name)
    t = _tensors(dtype)
    path = str(tmp_path / "ours.safetensors")
    deepnvme.save_safetensors(t, path)
    back = load_file(path)
    assert back.keys() == t.keys()
    assert all(_same(back[k], t[k]) for k in t)
    (n,) = struct.unpack("<Q", open(path, "rb").read(8))
    assert json.loads(open(path, "rb").read(8 + n)[8:])["x"]["dtype"] == name


@pytest.mark.parametrize("name", sorted(PACKAGE_DTYPES))
def test_we_read_what_the_package_writes(tmp_path, name):
    dtype = _dtype(name)
    t = _tensors(dtype)
    path = str(tmp_path / "theirs.safetensors")
    save_file(t, path)
    back = deepnvme.load_safetensors(path)
    assert back.keys() == t.keys()
    assert all(_same(back[k], t[k]) for k in t)
    assert {k: e.dtype for k, e in read_header(path).tensors.items()} == dict.fromkeys(t, dtype)


def test_f4_header_counts_four_bit_values(tmp_path):
    dtype = _dtype("F4")
    t = {"q": _random(dtype, (3, 4), 7)}
    ours, theirs = str(tmp_path / "ours.safetensors"), str(tmp_path / "theirs.safetensors")
    deepnvme.save_safetensors(t, ours)
    save_file(t, theirs)
    for path in (ours, theirs):
        (n,) = struct.unpack("<Q", open(path, "rb").read(8))
        entry = json.loads(open(path, "rb").read(8 + n)[8:])["q"]
        assert entry["shape"] == [3, 8] and entry["data_offsets"] == [0, 12]
    with pytest.raises(ValueError, match="0-d"):
        deepnvme.save_safetensors({"q": torch.zeros((), dtype=torch.uint8).view(dtype)}, tmp_path / "s.safetensors")


def test_metadata_and_many_dtypes_in_one_file(tmp_path):
    t = {name: _random(getattr(torch, attr), (3, 2), i) for i, (name, attr) in enumerate(PACKAGE_DTYPES.items())
         if isinstance(getattr(torch, attr, None), torch.dtype)}
    path = str(tmp_path / "all.safetensors")
    deepnvme.save_safetensors(t, path, metadata={"format": "pt"})
    back = load_file(path)
    assert all(_same(back[k], t[k]) for k in t)
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt"}
    assert read_header(path).metadata == {"format": "pt"}


def _file(header: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header)) + header + data


def _u8(name: str, begin: int, end: int) -> str:
    return f'"{name}":{{"dtype":"U8","shape":[{end - begin}],"data_offsets":[{begin},{end}]}}'


# Every loader that takes a file path reads its header through the one parser.
LOADERS = {
    "load_safetensors": deepnvme.load_safetensors,
    "read_header": read_header,
    "load_into": lambda p: deepnvme.load_into({"a": torch.zeros(4, dtype=torch.uint8)}, p, strict=False),
    "inference index": lambda p: read_checkpoint_index(str(p.parent)),
}


@pytest.mark.parametrize("content, message", [
    pytest.param(b"", "too short", id="empty file"),
    pytest.param(b"\x10\0\0\0", "too short", id="shorter than 8 bytes"),
    pytest.param(struct.pack("<Q", 64) + b'{"a":', "past the end", id="shorter than the header"),
    pytest.param(_file(b"{" + _u8("a", 0, 4).encode() + b"}", b"abc"), "'a'.*out of range",
                 id="truncated data"),
    pytest.param(_file(b"{" + _u8("a", 0, 4).encode() + b"," + _u8("b", 2, 6).encode() + b"}", b"x" * 6),
                 "'b'.*overlaps", id="overlapping offsets"),
    pytest.param(_file(b"{" + _u8("a", 0, 2).encode() + b"," + _u8("b", 3, 4).encode() + b"}", b"x" * 4),
                 "'b'.*hole", id="data with a hole"),
    pytest.param(struct.pack("<Q", 2) + b"{}" + b"xy", "cover 0 of the 2", id="trailing data"),
    pytest.param(_file(b"{" + _u8("a", 0, 1).encode() + b"," + _u8("a", 0, 1).encode() + b"}", b"x"),
                 "'a' appears twice", id="duplicate key"),
    pytest.param(struct.pack("<Q", 4) + b"\xff\xfe{}", "UTF-8", id="not utf-8"),
])
@pytest.mark.parametrize("loader", sorted(LOADERS))
def test_malformed_files_raise(tmp_path, content, message, loader):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    if loader == "inference index":
        path = path.rename(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointFormatError, match=message) as info:
        LOADERS[loader](path)
    assert path.name in str(info.value)


def test_oversized_header_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", MAX_HEADER + 1) + b"{")
        f.truncate(MAX_HEADER + 100)    # sparse: a reader that read the header would take a while
    for load in LOADERS.values():
        with pytest.raises(CheckpointFormatError, match="limit"):
            load(path)


def test_data_cut_short_is_caught(tmp_path):
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.arange(10), "b": torch.ones(3)}, str(path))
    raw = path.read_bytes()
    path.write_bytes(raw[:-1])
    with pytest.raises(CheckpointFormatError, match="'b'.*out of range"):
        deepnvme.load_safetensors(path)


def test_checkpoint_folder_uses_the_same_rules(tmp_path):
    save_file({"a": torch.arange(4)}, str(tmp_path / "s1.safetensors"))
    save_file({"b": torch.ones(2, dtype=torch.bfloat16)}, str(tmp_path / "s2.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    index = read_checkpoint_index(str(tmp_path))
    assert index["b"].dtype == torch.bfloat16 and index["b"].nbytes == 4
    assert index["a"].offset == read_header(tmp_path / "s1.safetensors").data_start
    with open(tmp_path / "s2.safetensors", "ab") as f:
        f.write(b"\0" * 8)   # bytes no tensor covers: the package refuses the file, so do we
    with pytest.raises(CheckpointFormatError, match="s2.safetensors.*cover 4 of the 12"):
        read_checkpoint_index(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "../s1.safetensors"}}))
    with pytest.raises(CheckpointFormatError, match="weight_map"):
        read_checkpoint_index(str(tmp_path))
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(CheckpointFormatError, match="index.json.*JSON"):
        read_checkpoint_index(str(tmp_path))
    assert os.path.exists(tmp_path / "s1.safetensors")
