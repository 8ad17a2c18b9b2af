"""formats.index.tensor_index on real files: safetensors and torch.save files written by their own
writers and read back at the offsets the index gives; one rule for duplicates and the weight_map,
applied by every reader that builds an index."""

from __future__ import annotations

import json
import os

import pytest
import safetensors.torch as st
import torch

import deepnvme
from deepnvme.errors import CheckpointFormatError
from deepnvme.formats.index import StoredTensor, tensor_index
from deepnvme.inference._safetensors import read_checkpoint_index
from deepnvme.integrations._weights import checkpoint_tensors
from deepnvme.offload._sources import make_source


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"embed": torch.randn(50, 8, generator=g), "norm": torch.ones(8, dtype=torch.bfloat16),
            "head": torch.randn(8, 50, generator=g).half(), "steps": torch.arange(5),
            "empty": torch.zeros(0, 3)}


def _read_back(s: StoredTensor) -> torch.Tensor:
    """The tensor at ``s``'s place, read with plain file I/O."""
    with open(s.file, "rb") as f:
        f.seek(s.offset)
        raw = bytearray(f.read(s.nbytes))
    data = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    values = data.view(s.dtype)
    return values.as_strided(s.shape, s.stride) if s.stride is not None else values.view(s.shape)


def _write_index(folder, weight_map: dict[str, str], name: str = "model.safetensors.index.json") -> str:
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return path


def _shards(folder, tensors: dict[str, torch.Tensor], kind: str = "safetensors") -> dict[str, str]:
    """Two shards, the tensors split in halves, and the index naming them; returns the weight_map."""
    names = list(tensors)
    stem, ext = ("model", "safetensors") if kind == "safetensors" else ("pytorch_model", "bin")
    weight_map = {}
    for i, part in enumerate((names[:2], names[2:]), 1):
        file = f"{stem}-{i:05d}-of-00002.{ext}"
        group = {n: tensors[n] for n in part}
        if kind == "safetensors":
            st.save_file(group, os.path.join(folder, file))
        else:
            torch.save(group, os.path.join(folder, file))
        weight_map.update(dict.fromkeys(part, file))
    _write_index(folder, weight_map, f"{stem}.{ext}.index.json")
    return weight_map


def _same(index, expected: dict[str, torch.Tensor]) -> None:
    assert sorted(index.tensors) == sorted(expected)
    for name, t in expected.items():
        s = index.tensors[name]
        assert s.name == name and s.dtype == t.dtype and s.shape == tuple(t.shape), name
        assert torch.equal(_read_back(s), t), name


def test_single_safetensors_file_read_back(tmp_path):
    tensors = _tensors()
    st.save_file(tensors, str(tmp_path / "weights.safetensors"))
    index = tensor_index(str(tmp_path / "weights.safetensors"))
    _same(index, tensors)
    assert index.files.files == (str(tmp_path / "weights.safetensors"),) and index.files.weight_map is None


@pytest.mark.parametrize("kind", ["safetensors", "torch"])
def test_sharded_folder_read_back(tmp_path, kind):
    tensors = _tensors()
    if kind == "torch":
        tensors["head"] = tensors["head"].t()                  # a strided view: its storage and stride
    weight_map = _shards(tmp_path, tensors, kind)
    (tmp_path / "stray.safetensors").write_bytes(b"not read: the index does not name it")
    (tmp_path / "stray.bin").write_bytes(b"not read either")
    index = tensor_index(str(tmp_path))
    _same(index, tensors)
    assert index.files.kind == kind and {os.path.basename(t.file) for t in index.tensors.values()} == set(
        weight_map.values())
    assert all(index.tensors[n].file == str(tmp_path / f) for n, f in weight_map.items())
    order = index.in_file_order()
    assert order == sorted(order, key=lambda t: (t.file, t.offset))


def test_folder_without_an_index_reads_every_safetensors_file_only_when_asked(tmp_path):
    tensors = _tensors()
    st.save_file({"embed": tensors["embed"]}, str(tmp_path / "consolidated.safetensors"))
    st.save_file({"norm": tensors["norm"]}, str(tmp_path / "extra.safetensors"))
    _same(tensor_index(str(tmp_path), kinds=("safetensors",), any_safetensors=True),
          {"embed": tensors["embed"], "norm": tensors["norm"]})
    with pytest.raises(CheckpointFormatError, match="holds no checkpoint"):
        tensor_index(str(tmp_path))


def test_a_shard_format_is_told_by_its_bytes(tmp_path):
    tensors = _tensors()
    torch.save({"embed": tensors["embed"]}, tmp_path / "a.safetensors")      # a zip under the wrong name
    _same(tensor_index(str(tmp_path / "a.safetensors")), {"embed": tensors["embed"]})
    with pytest.raises(CheckpointFormatError, match="a.safetensors.*zip file"):  # a safetensors-only reader
        tensor_index(str(tmp_path / "a.safetensors"), kinds=("safetensors",))


@pytest.mark.parametrize("with_index", [True, False], ids=["index", "no index"])
def test_duplicate_across_shards_names_both_files(tmp_path, with_index):
    t = _tensors()
    st.save_file({"embed": t["embed"], "norm": t["norm"]}, str(tmp_path / "s1.safetensors"))
    st.save_file({"head": t["head"], "norm": t["norm"] * 2}, str(tmp_path / "s2.safetensors"))
    if with_index:
        _write_index(tmp_path, {"embed": "s1.safetensors", "norm": "s1.safetensors", "head": "s2.safetensors"})
    with pytest.raises(CheckpointFormatError) as info:
        tensor_index(str(tmp_path), any_safetensors=True)
    message = str(info.value)
    assert "'norm'" in message and str(tmp_path / "s1.safetensors") in message
    assert str(tmp_path / "s2.safetensors") in message


def test_duplicate_across_torch_shards(tmp_path):
    t = _tensors()
    _shards(tmp_path, t, "torch")
    torch.save({"head": t["head"], "embed": t["embed"]}, tmp_path / "pytorch_model-00002-of-00002.bin")
    with pytest.raises(CheckpointFormatError, match=r"'embed' is in both .*00001-of-00002.bin.* and "
                                                    r".*00002-of-00002.bin"):
        tensor_index(str(tmp_path))


def test_weight_map_pointing_to_the_wrong_shard(tmp_path):
    weight_map = _shards(tmp_path, _tensors())
    first, second = sorted(set(weight_map.values()))
    index = _write_index(tmp_path, {**weight_map, "embed": second})   # embed is in the first shard
    with pytest.raises(CheckpointFormatError) as info:
        tensor_index(str(tmp_path))
    message = str(info.value)
    assert index in message and "'embed'" in message
    assert str(tmp_path / first) in message and str(tmp_path / second) in message


def test_weight_map_naming_a_tensor_no_shard_holds(tmp_path):
    weight_map = _shards(tmp_path, _tensors())
    _write_index(tmp_path, {**weight_map, "lost": sorted(weight_map.values())[0]})
    with pytest.raises(CheckpointFormatError, match="'lost'.*no shard holds it"):
        tensor_index(str(tmp_path))


def test_tensors_the_weight_map_leaves_out_are_kept(tmp_path):
    tensors = _tensors()
    weight_map = _shards(tmp_path, tensors)
    del weight_map["steps"]
    _write_index(tmp_path, weight_map)
    _same(tensor_index(str(tmp_path)), tensors)


def _via_load_into(path: str) -> object:
    return deepnvme.load_into({}, path, strict=False)


def _via_offload_source(path: str) -> object:
    source = make_source(path, None)
    assert source is not None
    source.close()
    return source


READERS = {
    "load_into": _via_load_into,
    "weight stream (vLLM)": checkpoint_tensors,
    "offload source": _via_offload_source,
    "inference": read_checkpoint_index,
}


@pytest.mark.parametrize("reader", sorted(READERS))
def test_every_reader_applies_the_one_rule(tmp_path, reader):
    """A duplicated tensor was once kept silently (the last copy won) by the offload source, and
    the weight_map was not checked by the offload source and the inference index."""
    t = _tensors()
    weight_map = _shards(tmp_path, t)
    first, second = sorted(set(weight_map.values()))
    READERS[reader](str(tmp_path))                                         # consistent: fine
    _write_index(tmp_path, {**weight_map, "embed": second})
    with pytest.raises(CheckpointFormatError, match=f"'embed' in '.*{second}', but it is in '.*{first}'"):
        READERS[reader](str(tmp_path))
    _write_index(tmp_path, weight_map)
    st.save_file({n: t[n] for n in ("head", "steps", "empty", "embed")}, str(tmp_path / second))
    with pytest.raises(CheckpointFormatError, match=f"'embed' is in both '.*{first}' and '.*{second}'"):
        READERS[reader](str(tmp_path))
