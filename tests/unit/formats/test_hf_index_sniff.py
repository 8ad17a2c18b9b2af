"""sniff_file: "safetensors" for what the safetensors package writes, "torch" for a torch.save
zip, None for an empty or short file, random bytes, a header length the file cannot hold and a
missing file."""

import struct

import safetensors.torch
import torch

from deepnvme.formats.hf_index import sniff_file
from deepnvme.formats.torchzip import ZIP_MAGIC


def test_tells_safetensors_from_other_bytes(tmp_path):
    real = tmp_path / "a.bin"
    safetensors.torch.save_file({"x": torch.ones(3)}, real)
    assert sniff_file(real) == "safetensors"
    empty_dict = tmp_path / "empty.safetensors"
    safetensors.torch.save_file({}, empty_dict)
    assert sniff_file(empty_dict) == "safetensors"
    zipped = tmp_path / "b.safetensors"
    torch.save({"x": torch.ones(3)}, zipped)
    assert zipped.read_bytes().startswith(ZIP_MAGIC) and sniff_file(zipped) == "torch"
    cases = {"empty": b"", "short": b"\x02\x00\x00", "random": bytes(range(200, 256)) * 4,
             "too long": struct.pack("<Q", 10_000) + b"{}",
             "not json": struct.pack("<Q", 2) + b"[]"}
    for name, raw in cases.items():
        path = tmp_path / name
        path.write_bytes(raw)
        assert sniff_file(path) is None, name
    assert sniff_file(tmp_path / "missing") is None
