"""The streaming loader's pure parts: extra-config validation, layer assignment, resident choice."""

import warnings

import pytest
import torch

from deepnvme import _deprecation
from deepnvme.errors import ConfigError
from deepnvme.formats.safetensors import StoredTensor
from deepnvme.integrations._layer_stream import assign_tensors, choose_resident, stream_options


def _t(name):
    return StoredTensor(name, "f", 0, 4, torch.float32, (1,))


def test_options_parse_and_keep_the_io_settings():
    opts = stream_options({"packed_dir": "/d", "memory_budget": "2G", "prefetch": 3,
                           "queue_depth": 8, "read_window": "1M"}, load_format="deepnvme_stream")
    assert (opts.packed_dir, opts.memory_budget, opts.prefetch) == ("/d", 2 << 30, 3)
    assert opts.loader.io.queue_depth == 8 and opts.loader.read_window == 1 << 20
    assert stream_options({"packed_dir": "/d"}, load_format="x").memory_budget is None


@pytest.mark.parametrize("extra, key", [
    (None, "packed_dir"),
    ({"packed_dir": ""}, "packed_dir"),
    ({"packed_dir": "/d", "memory_budget": "lots"}, "memory_budget"),
    ({"packed_dir": "/d", "memory_budget": -1}, "memory_budget"),
    ({"packed_dir": "/d", "prefetch": "2"}, "prefetch"),
    ({"packed_dir": "/d", "prefetch": True}, "prefetch"),
    ({"packed_dir": "/d", "engine": "spdk"}, "engine"),
    ({"packed_dir": "/d", "budget": 1}, "budget"),
])
def test_bad_settings_name_the_key(extra, key):
    with pytest.raises(ConfigError, match=repr(key)) as info:
        stream_options(extra, load_format="deepnvme_stream")
    assert "model_loader_extra_config" in str(info.value)


def test_unknown_key_lists_the_streaming_keys_too():
    with pytest.raises(ConfigError, match="deepnvme_stream.*memory_budget.*packed_dir.*prefetch"):
        stream_options({"packed_dir": "/d", "nope": 1}, load_format="deepnvme_stream")


def test_the_old_key_offload_dir_works_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(_deprecation, "_warned", set())   # the ledger is per process
    with warnings.catch_warnings(record=True) as record, caplog.at_level("WARNING", logger="deepnvme"):
        warnings.simplefilter("always")
        for _ in range(2):
            opts = stream_options({"offload_dir": "/old", "prefetch": 2}, load_format="deepnvme_offload")
            assert (opts.packed_dir, opts.prefetch) == ("/old", 2)
    messages = [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)]
    assert messages == ["model_loader_extra_config['offload_dir'] is deprecated and will be removed "
                        "in the next release; use 'packed_dir'"]
    assert [r.getMessage() for r in caplog.records] == ["deepnvme: " + messages[0]]
    with pytest.raises(ConfigError, match="both 'offload_dir' and 'packed_dir'"):
        stream_options({"offload_dir": "/a", "packed_dir": "/b"}, load_format="deepnvme_stream")


def test_tensors_go_to_the_layer_named_by_their_prefix():
    names = ["model.layers.0", "model.layers.1", "model.layers.10"]
    tensors = [_t("model.embed_tokens.weight"), _t("model.layers.1.mlp.down_proj.weight"),
               _t("model.layers.10.self_attn.q_proj.weight"), _t("model.layers.0.input_layernorm.weight"),
               _t("model.layers.2.mlp.up_proj.weight"), _t("lm_head.weight")]
    per_block, rest = assign_tensors(tensors, names)
    assert [[t.name for t in b] for b in per_block] == [
        ["model.layers.0.input_layernorm.weight"], ["model.layers.1.mlp.down_proj.weight"],
        ["model.layers.10.self_attn.q_proj.weight"]]
    assert [t.name for t in rest] == ["model.embed_tokens.weight", "model.layers.2.mlp.up_proj.weight",
                                      "lm_head.weight"]


@pytest.mark.parametrize("sizes, room, expected", [
    ([10] * 8, 0, []),
    ([10] * 8, 9, []),
    ([10] * 8, 10, [4]),
    ([10] * 8, 25, [2, 6]),
    ([10] * 8, 40, [1, 3, 5, 7]),
    ([10] * 8, 80, list(range(8))),
    ([10] * 8, 1000, list(range(8))),
    ([50, 5, 50, 5], 12, [1, 3]),      # uneven: the spread does not fit, the smallest do
])
def test_resident_layers_fit_and_spread(sizes, room, expected):
    got = choose_resident(sizes, room)
    assert got == expected and sum(sizes[i] for i in got) <= room
