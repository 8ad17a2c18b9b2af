"""mmap=True loads: copy-on-write views of the file, read in up front by parallel populate."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

import deepnvme
from deepnvme.errors import DeepNVMeIOError
from deepnvme.io import mapped
from deepnvme.io.posix import evict_page_cache, resident_bytes

safetensors_torch = pytest.importorskip("safetensors.torch")


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(512, 600, generator=g), "b": torch.arange(13, dtype=torch.int8),
            "h": torch.randn(9, generator=g).half(), "bf": torch.randn(3, 5, generator=g).bfloat16(),
            "empty": torch.empty(0, 4)}


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def _mapped(path: os.PathLike[str] | str) -> bool:
    with open("/proc/self/maps") as f:
        return str(path) in f.read()


@pytest.mark.parametrize("writer", ["safetensors", "deepnvme"])
def test_safetensors_mmap_is_mapped_and_resident(tmp_path, writer):
    path = tmp_path / "m.safetensors"
    sd = _state()
    (safetensors_torch.save_file if writer == "safetensors" else deepnvme.save_safetensors)(sd, str(path))
    evict_page_cache(str(path))
    assert resident_bytes(str(path)) == 0
    got = deepnvme.load_safetensors(path, mmap=True)
    assert _mapped(path)
    assert resident_bytes(str(path)) == os.path.getsize(path)  # populated before returning
    _same(got, safetensors_torch.load_file(str(path)))


def test_populate_false_leaves_pages_unread(tmp_path):
    path = tmp_path / "m.safetensors"
    sd = {"big": torch.randn(1 << 20)}
    safetensors_torch.save_file(sd, str(path))
    evict_page_cache(str(path))
    got = deepnvme.load_safetensors(path, mmap=True, populate=False)
    assert resident_bytes(str(path)) < os.path.getsize(path) // 2
    _same(got, sd)


@pytest.mark.parametrize("writer", ["torch", "deepnvme"])
def test_torch_file_mmap_is_mapped_resident_and_copy_on_write(tmp_path, writer):
    path = tmp_path / "ck.pt"
    sd = _state()
    (torch.save if writer == "torch" else deepnvme.save)(sd, path)
    evict_page_cache(str(path))
    got = deepnvme.load(path, mmap=True)
    assert _mapped(path) and resident_bytes(str(path)) == os.path.getsize(path)
    _same(got, sd)
    got["w"].add_(1.0)  # a private mapping: the file keeps its bytes
    _same(torch.load(path, weights_only=True), sd)


def test_folder_mmap(tmp_path):
    sd = _state()
    deepnvme.save_safetensors(sd, str(tmp_path / "model.safetensors"))
    _same(deepnvme.load_safetensors(tmp_path, mmap=True), sd)


def test_populate_of_a_file_that_shrank_names_the_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(3 * 4096))
    storage = mapped.map_private(str(path))
    os.truncate(path, 4096)
    with pytest.raises(DeepNVMeIOError) as err:
        mapped.populate(storage, path=str(path), threads=2)
    assert str(path) in str(err.value)


def test_kernel_without_populate_falls_back_and_says_so(tmp_path, monkeypatch, caplog):
    def refuse(addr: int, length: int, advice: int) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(mapped, "madvise", refuse)
    path = tmp_path / "m.safetensors"
    sd = _state()
    safetensors_torch.save_file(sd, str(path))
    evict_page_cache(str(path))
    with caplog.at_level(logging.INFO, logger="deepnvme"):
        got = deepnvme.load_safetensors(path, mmap=True)
    assert "MADV_POPULATE_READ is not supported" in caplog.text
    assert resident_bytes(str(path)) == os.path.getsize(path)
    _same(got, sd)


def test_empty_file_maps_to_nothing(tmp_path):
    path = tmp_path / "empty"
    path.write_bytes(b"")
    storage = mapped.map_private(str(path))
    mapped.populate(storage, path=str(path), threads=2)
    assert storage.nbytes() == 0
