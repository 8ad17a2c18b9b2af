"""The vLLM loader's framework-free parts: extra-config validation and read-range planning."""

import pytest
import torch

from deepnvme.config import CHECKPOINT_DEFAULTS, IOConfig
from deepnvme.errors import ConfigError
from deepnvme.formats.safetensors import StoredTensor
from deepnvme.integrations._weights import DEFAULT_READ_WINDOW, loader_options, plan_ranges


@pytest.fixture(autouse=True)
def _no_env(monkeypatch):
    import os
    for key in list(os.environ):
        if key.startswith("DEEPNVME_"):
            monkeypatch.delenv(key)


def test_defaults_take_the_checkpoint_profile():
    opts = loader_options(None)
    assert opts.read_window == DEFAULT_READ_WINDOW
    for key, value in CHECKPOINT_DEFAULTS.items():
        assert getattr(opts.io, key) == value
    assert opts.io.block_size == IOConfig().block_size


def test_settings_and_window_are_parsed():
    opts = loader_options({"block_size": "4M", "queue_depth": 8, "intra_op_parallelism": 2,
                           "engine": "threads", "o_direct": False, "read_window": "16M"})
    assert (opts.io.block_size, opts.io.queue_depth, opts.io.intra_op_parallelism) == (4 << 20, 8, 2)
    assert opts.io.engine == "threads" and opts.io.o_direct is False
    assert opts.read_window == 16 << 20


@pytest.mark.parametrize("extra, key", [
    ({"blocksize": 1}, "blocksize"),
    ({"block_size": "lots"}, "block_size"),
    ({"queue_depth": 0}, "queue_depth"),
    ({"engine": "spdk"}, "engine"),
    ({"o_direct": "maybe"}, "o_direct"),
    ({"read_window": "big"}, "read_window"),
    ({"read_window": 0}, "read_window"),
])
def test_bad_keys_and_values_name_the_key(extra, key):
    with pytest.raises(ConfigError, match=repr(key)) as info:
        loader_options(extra)
    assert "model_loader_extra_config" in str(info.value)


def test_unknown_key_lists_the_known_ones():
    with pytest.raises(ConfigError, match="read_window.*|block_size") as info:
        loader_options({"nope": 1})
    assert "read_window" in str(info.value) and "queue_depth" in str(info.value)


def test_not_a_mapping():
    with pytest.raises(ConfigError, match="JSON object"):
        loader_options(["block_size"])  # type: ignore[arg-type]


def _t(name, file, offset, nbytes):
    return StoredTensor(name, file, offset, nbytes, torch.uint8, (nbytes,))


def test_ranges_join_contiguous_tensors_up_to_the_window():
    ts = [_t("a", "f", 8, 4), _t("b", "f", 12, 4), _t("c", "f", 16, 4), _t("d", "g", 8, 4)]
    ranges = plan_ranges(ts, 8)
    assert [(r.file, r.offset, r.nbytes, [t.name for t in r.tensors]) for r in ranges] == [
        ("f", 8, 8, ["a", "b"]), ("f", 16, 4, ["c"]), ("g", 8, 4, ["d"])]


def test_large_tensor_gets_its_own_range_and_gaps_split():
    ts = [_t("a", "f", 0, 2), _t("big", "f", 2, 100), _t("c", "f", 102, 2), _t("d", "f", 200, 2)]
    ranges = plan_ranges(ts, 10)
    assert [[t.name for t in r.tensors] for r in ranges] == [["a"], ["big"], ["c"], ["d"]]
    assert all(r.nbytes == sum(t.nbytes for t in r.tensors) for r in ranges)


def test_empty_tensors_and_empty_plan():
    assert plan_ranges([], 10) == []
    ranges = plan_ranges([_t("e", "f", 8, 0), _t("a", "f", 8, 4)], 10)
    assert len(ranges) == 1 and ranges[0].nbytes == 4
    with pytest.raises(ValueError):
        plan_ranges([], 0)


def test_view_of_a_misaligned_tensor_is_a_copy_with_the_right_values():
    from deepnvme.integrations._weights import _view
    values = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float32)
    buffer = torch.cat([torch.zeros(2, dtype=torch.uint8), values.view(torch.uint8)])
    stored = StoredTensor("w", "f", 2, 12, torch.float32, (3,))
    assert torch.equal(_view(buffer, 2, stored), values)
    aligned = torch.cat([torch.zeros(4, dtype=torch.uint8), values.view(torch.uint8)])
    view = _view(aligned, 4, StoredTensor("w", "f", 4, 12, torch.float32, (3,)))
    assert torch.equal(view, values) and view.untyped_storage().data_ptr() == aligned.data_ptr()
