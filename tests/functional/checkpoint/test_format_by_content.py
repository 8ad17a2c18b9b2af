"""The checkpoint's format is told by its bytes, not its name: ``load_into`` reads a safetensors
file named ``.bin`` and a torch.save file named ``.safetensors``; ``load`` and
``load_safetensors`` given the other format say which function reads it."""

import pytest
import safetensors.torch
import torch

import deepnvme
from deepnvme import CheckpointFormatError


def tensors():
    torch.manual_seed(0)
    return {"w": torch.randn(64, 33), "b": torch.arange(7, dtype=torch.int64)}


def test_load_into_reads_either_format_whatever_its_name(tmp_path):
    want = tensors()
    misnamed_st, misnamed_pt = tmp_path / "model.bin", tmp_path / "model.safetensors"
    safetensors.torch.save_file(want, misnamed_st)
    torch.save(want, misnamed_pt)
    for path in (misnamed_st, misnamed_pt):
        target = {k: torch.zeros_like(v) for k, v in want.items()}
        assert deepnvme.load_into(target, path) == ([], [])
        assert all(torch.equal(target[k], v) for k, v in want.items()), path


def test_load_of_a_safetensors_file_names_load_safetensors(tmp_path):
    path = tmp_path / "model.pt"
    safetensors.torch.save_file(tensors(), path)
    with pytest.raises(CheckpointFormatError, match=r"model.pt' is a safetensors file.*load_safetensors"):
        deepnvme.load(path)


def test_load_safetensors_of_a_torch_save_file_names_load(tmp_path):
    path = tmp_path / "model.safetensors"
    torch.save(tensors(), path)
    with pytest.raises(CheckpointFormatError, match=r"model.safetensors'.*zip file.*deepnvme.load"):
        deepnvme.load_safetensors(path)
