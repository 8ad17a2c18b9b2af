"""The Hugging Face index parser and weight-map check: pure, no disk."""

from __future__ import annotations

import json

import pytest

from deepnvme.errors import CheckpointFormatError
from deepnvme.formats.hf_index import CheckpointFiles, check_weight_map, file_kind, parse_index


def _raw(obj: object) -> bytes:
    return json.dumps(obj).encode()


def test_parse_index_returns_weight_map():
    raw = _raw({"metadata": {"total_size": 10}, "weight_map": {"a": "m-1.safetensors", "b": "m-2.safetensors"}})
    assert parse_index(raw, file="i.json") == {"a": "m-1.safetensors", "b": "m-2.safetensors"}
    assert parse_index(_raw({"weight_map": {"a": "x.bin"}}), file="i.json") == {"a": "x.bin"}


@pytest.mark.parametrize("raw, words", [
    (b"\xff\xfe", ["i.json", "UTF-8"]),
    (b"{not json", ["i.json", "JSON"]),
    (_raw([1, 2]), ["i.json", "object"]),
    (_raw({"metadata": 3, "weight_map": {"a": "x"}}), ["'metadata'"]),
    (_raw({"metadata": {}}), ["'weight_map'"]),
    (_raw({"weight_map": []}), ["'weight_map'"]),
    (_raw({"weight_map": {}}), ["'weight_map'", "empty"]),
    (_raw({"weight_map": {"a": "../x.safetensors"}}), ["weight_map['a']", "plain file name"]),
    (_raw({"weight_map": {"a": "/etc/passwd"}}), ["weight_map['a']"]),
    (_raw({"weight_map": {"a": "sub/x.bin"}}), ["weight_map['a']"]),
    (_raw({"weight_map": {"a": ".."}}), ["weight_map['a']"]),
    (_raw({"weight_map": {"a": 3}}), ["weight_map['a']"]),
])
def test_parse_index_refuses_with_file_and_field(raw, words):
    with pytest.raises(CheckpointFormatError) as info:
        parse_index(raw, file="i.json")
    for word in words:
        assert word in str(info.value)


def test_file_kind_from_name():
    assert file_kind("x/model.safetensors") == "safetensors"
    assert file_kind("x/pytorch_model.bin") == "torch"
    assert file_kind("x.pt") == "torch"


def test_check_weight_map():
    files = CheckpointFiles("safetensors", ("d/1", "d/2"), {"a": "d/1", "b": "d/2"}, "d/i.json")
    check_weight_map(files, {"a": "d/1", "b": "d/2", "extra": "d/2"})
    with pytest.raises(CheckpointFormatError, match="puts 'b' in 'd/2', but it is in 'd/1'"):
        check_weight_map(files, {"a": "d/1", "b": "d/1"})
    with pytest.raises(CheckpointFormatError, match="no shard holds it"):
        check_weight_map(files, {"a": "d/1"})
    check_weight_map(CheckpointFiles("torch", ("f",)), {})
