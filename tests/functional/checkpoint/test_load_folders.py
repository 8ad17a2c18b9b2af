"""deepnvme.load and deepnvme.load_safetensors on Hugging Face checkpoint folders."""

from __future__ import annotations

import json

import pytest
import safetensors.torch as st
import torch

import deepnvme
from deepnvme.errors import CheckpointFormatError

from .test_load_into import _shard, _trained


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b) or sorted(a) == sorted(b)
    for k in b:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_sharded_folder_loads_as_one_dict(tmp_path, kind):
    sd = _trained().state_dict()
    assert _shard(sd, str(tmp_path), kind, 40_000) >= 3
    (tmp_path / "stray.safetensors").write_bytes(b"not named by the index")
    (tmp_path / "stray.bin").write_bytes(b"not named by the index")
    out = deepnvme.load_safetensors(tmp_path) if kind == "safetensors" else deepnvme.load(tmp_path)
    _same(out, sd)


def test_single_file_folders(tmp_path):
    sd = _trained().state_dict()
    st.save_file(sd, str(tmp_path / "model.safetensors"))
    torch.save(sd, tmp_path / "pytorch_model.bin")
    _same(deepnvme.load_safetensors(tmp_path), sd)
    _same(deepnvme.load(tmp_path), sd)


def test_load_passes_its_options_to_each_shard(tmp_path):
    sd = _trained().state_dict()
    _shard(sd, str(tmp_path), "torch", 40_000)
    out = deepnvme.load(tmp_path, map_location="meta")
    assert all(t.device.type == "meta" for t in out.values())
    _same(deepnvme.load(tmp_path, mmap=True), sd)


def test_transformers_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=64)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    out = deepnvme.load_safetensors(tmp_path)
    ref = {}
    for file in sorted(tmp_path.glob("*.safetensors")):
        ref.update(st.load_file(str(file)))
    _same(out, ref)


def test_folder_faults(tmp_path):
    with pytest.raises(CheckpointFormatError, match="holds no checkpoint"):
        deepnvme.load_safetensors(tmp_path)
    torch.save({"a": torch.ones(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointFormatError, match="model.safetensors"):   # wrong kind for this call
        deepnvme.load_safetensors(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    st.save_file({"a": torch.ones(2)}, str(tmp_path / "s1.safetensors"))
    st.save_file({"a": torch.zeros(2)}, str(tmp_path / "s2.safetensors"))
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}}))
    with pytest.raises(CheckpointFormatError, match="'a' is in both"):
        deepnvme.load_safetensors(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a": "../s1.safetensors"}}))
    with pytest.raises(CheckpointFormatError, match="plain file name"):
        deepnvme.load_safetensors(tmp_path)
    index.write_text(json.dumps({"weight_map": {"a": "s3.safetensors"}}))
    with pytest.raises(CheckpointFormatError, match="'s3.safetensors', which is not in the folder"):
        deepnvme.load_safetensors(tmp_path)
    index.write_text("{")
    with pytest.raises(CheckpointFormatError, match="index.json"):
        deepnvme.load_safetensors(tmp_path)
