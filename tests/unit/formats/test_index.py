"""The tensor index's rules, pure: duplicates, the weight_map, a file's parser, the read order."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deepnvme.errors import CheckpointFormatError
from deepnvme.formats.hf_index import CheckpointFiles
from deepnvme.formats.index import StoredTensor, TensorIndex, file_format, merge, owners

LOOSE = CheckpointFiles("safetensors", ("d/1", "d/2"))
INDEXED = CheckpointFiles("safetensors", ("d/1", "d/2"), {"a": "d/1", "b": "d/2"}, "d/index.json")


def _t(name: str, file: str, offset: int = 0) -> StoredTensor:
    return StoredTensor(name, file, offset, 4, torch.float32, (1,))


def test_owners_maps_each_name_to_its_file():
    assert owners([("d/1", ["a"]), ("d/2", ["b", "c"])], LOOSE) == {"a": "d/1", "b": "d/2", "c": "d/2"}
    # a tensor the weight_map does not name is kept: the files are the truth
    assert owners([("d/1", ["a"]), ("d/2", ["b", "extra"])], INDEXED)["extra"] == "d/2"


@pytest.mark.parametrize("files", [LOOSE, INDEXED], ids=["no index", "index"])
def test_a_name_in_two_files_names_both(files):
    with pytest.raises(CheckpointFormatError) as info:
        owners([("d/1", ["a"]), ("d/2", ["b", "a"])], files)
    assert "'a' is in both 'd/1' and 'd/2'" in str(info.value)


def test_a_name_twice_in_one_file_part_is_not_a_duplicate():
    # one file's parser already refuses repeated keys; the same file listed once is fine
    assert owners([("d/1", ["a", "a"])], CheckpointFiles("safetensors", ("d/1",))) == {"a": "d/1"}


def test_weight_map_pointing_to_a_file_without_the_tensor():
    with pytest.raises(CheckpointFormatError) as info:
        owners([("d/1", ["a", "b"]), ("d/2", [])], INDEXED)
    message = str(info.value)
    assert "'d/index.json'" in message and "'b'" in message and "'d/2'" in message and "'d/1'" in message
    with pytest.raises(CheckpointFormatError, match="'b' in 'd/2', but no shard holds it"):
        owners([("d/1", ["a"]), ("d/2", [])], INDEXED)


def test_merge_keeps_file_then_parser_order_and_is_read_only():
    index = merge([("d/1", {"z": _t("z", "d/1", 8), "a": _t("a", "d/1", 0)}),
                   ("d/2", {"b": _t("b", "d/2")})], INDEXED)
    assert list(index.tensors) == ["z", "a", "b"]
    assert [t.name for t in index.in_file_order()] == ["a", "z", "b"]
    assert index.files is INDEXED
    with pytest.raises(TypeError):
        index.tensors["c"] = _t("c", "d/1")  # type: ignore[index]
    with pytest.raises(dataclasses.FrozenInstanceError):
        index.files = LOOSE  # type: ignore[misc]


def test_merge_applies_the_rule():
    with pytest.raises(CheckpointFormatError, match="'a' is in both 'd/1' and 'd/2'"):
        merge([("d/1", {"a": _t("a", "d/1")}), ("d/2", {"a": _t("a", "d/2")})], LOOSE)


def test_an_empty_index_is_an_index():
    index = TensorIndex(files=CheckpointFiles("safetensors", ()), tensors={})
    assert index.in_file_order() == []


@pytest.mark.parametrize("sniffed, named, kinds, expected", [
    ("torch", "safetensors", ("safetensors", "torch"), "torch"),          # bytes beat the name
    (None, "torch", ("safetensors", "torch"), "torch"),                   # unknown bytes: the name
    ("torch", "safetensors", ("safetensors",), "safetensors"),            # the caller reads one format
    ("torch", "torch", ("safetensors",), "safetensors"),                  # its parser says what is wrong
    ("safetensors", "torch", ("torch",), "torch"),
])
def test_file_format(sniffed, named, kinds, expected):
    assert file_format(sniffed, named, kinds) == expected
