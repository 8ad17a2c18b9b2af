"""looks_like_safetensors: true for what the safetensors package writes, false for a zip, an
empty or short file, random bytes and a header length the file cannot hold."""

import struct

import safetensors.torch
import torch

from deepnvme.formats.safetensors import ZIP_MAGIC, looks_like_safetensors


def test_tells_safetensors_from_other_bytes(tmp_path):
    real = tmp_path / "a.bin"
    safetensors.torch.save_file({"x": torch.ones(3)}, real)
    assert looks_like_safetensors(real)
    empty_dict = tmp_path / "empty.safetensors"
    safetensors.torch.save_file({}, empty_dict)
    assert looks_like_safetensors(empty_dict)
    zipped = tmp_path / "b.safetensors"
    torch.save({"x": torch.ones(3)}, zipped)
    assert zipped.read_bytes().startswith(ZIP_MAGIC) and not looks_like_safetensors(zipped)
    cases = {"empty": b"", "short": b"\x02\x00\x00", "random": bytes(range(200, 256)) * 4,
             "too long": struct.pack("<Q", 10_000) + b"{}",
             "not json": struct.pack("<Q", 2) + b"[]"}
    for name, raw in cases.items():
        path = tmp_path / name
        path.write_bytes(raw)
        assert not looks_like_safetensors(path), name
    assert not looks_like_safetensors(tmp_path / "missing")
