"""deepnvme.save_safetensors / load_safetensors against the safetensors package, both ways."""

from __future__ import annotations

import errno
import json
import os
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import deepnvme
from deepnvme.errors import CheckpointFormatError
from deepnvme.io.posix import Posix, injected


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(257, 129, generator=g),
        "bf16": torch.randn(1000, generator=g).bfloat16(),
        "f16": torch.randn(3, 3, generator=g).half(),
        "i8": torch.randint(-100, 100, (77,), dtype=torch.int8, generator=g),
        "i64": torch.arange(5),
        "bool": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.0),
        "big": torch.randn(300_000, generator=g),
    }


def test_package_reads_ours(tmp_path):
    t = _tensors()
    path = str(tmp_path / "m.safetensors")
    deepnvme.save_safetensors(t, path, metadata={"format": "pt", "step": "3"})
    back = load_file(path)
    assert back.keys() == t.keys()
    for k in t:
        assert back[k].dtype == t[k].dtype and torch.equal(back[k], t[k])
    with safe_open(path, "pt") as f:
        assert f.metadata() == {"format": "pt", "step": "3"}
    (n,) = struct.unpack("<Q", open(path, "rb").read(8))
    assert (8 + n) % 4096 == 0  # data section starts O_DIRECT-aligned
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_we_read_the_package(tmp_path):
    t = _tensors()
    path = str(tmp_path / "p.safetensors")
    save_file(t, path, metadata={"a": "b"})
    back = deepnvme.load_safetensors(path)
    assert back.keys() == t.keys()
    for k in t:
        assert back[k].dtype == t[k].dtype and back[k].shape == t[k].shape
        assert torch.equal(back[k], t[k])


def test_rejects_what_the_package_rejects(tmp_path):
    base = torch.ones(10)
    with pytest.raises(ValueError, match="share memory"):
        deepnvme.save_safetensors({"a": base, "b": base}, tmp_path / "x.safetensors")
    with pytest.raises(ValueError, match="contiguous"):
        deepnvme.save_safetensors({"a": torch.ones(3, 4).t()}, tmp_path / "x.safetensors")
    assert os.listdir(tmp_path) == []


def test_truncated_or_corrupt_files_raise(tmp_path):
    path = str(tmp_path / "p.safetensors")
    save_file(_tensors(), path)
    raw = open(path, "rb").read()
    for cut in (len(raw) - 1, 100, 4):
        bad = tmp_path / f"cut{cut}.safetensors"
        bad.write_bytes(raw[:cut])
        with pytest.raises(CheckpointFormatError):
            deepnvme.load_safetensors(bad)
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header["w"]["data_offsets"][1] += 4
    bad_header = json.dumps(header).encode()
    bad = tmp_path / "offsets.safetensors"
    bad.write_bytes(struct.pack("<Q", len(bad_header)) + bad_header + raw[8 + n:])
    with pytest.raises(CheckpointFormatError):
        deepnvme.load_safetensors(bad)


class _NoSpace(Posix):
    def pwritev(self, fd, buffers, offset):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_enospc_keeps_previous_file(tmp_path):
    path = str(tmp_path / "m.safetensors")
    deepnvme.save_safetensors({"a": torch.ones(10_000)}, path)
    with pytest.raises(OSError) as info:
        with injected(_NoSpace()):
            deepnvme.save_safetensors({"a": torch.zeros(10_000)}, path)
    assert info.value.errno == errno.ENOSPC
    assert torch.equal(load_file(path)["a"], torch.ones(10_000))
    assert os.listdir(tmp_path) == ["m.safetensors"]
