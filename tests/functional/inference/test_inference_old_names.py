"""The inference names that said "offload" still work for one release, each warning once."""

import importlib
import warnings

import pytest
import torch
from tiny_transformers import greedy, prompt, tiny_model

import deepnvme
import deepnvme.inference as inf
from deepnvme import _deprecation


@pytest.fixture(autouse=True)
def fresh_ledger(monkeypatch):
    monkeypatch.setattr(_deprecation, "_warned", set())   # a name warns once per process


def _deprecations(record):
    return [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)]


def test_new_names_are_public_and_old_ones_are_not_listed():
    assert {"stream_weights", "load_streamed"} <= set(inf.__all__)
    assert not {"offload", "load_offloaded"} & set(inf.__all__)
    assert deepnvme.inference.stream_weights is inf.stream_weights
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert inf.stream_weights is importlib.import_module("deepnvme.inference.install").stream_weights
        assert inf.load_streamed.__name__ == "load_streamed"
    assert _deprecations(record) == []


@pytest.mark.parametrize(("module", "old", "new"), [
    ("deepnvme.inference", "offload", "stream_weights"),
    ("deepnvme.inference", "load_offloaded", "load_streamed"),
    ("deepnvme.inference.install", "offload", "stream_weights"),
    ("deepnvme.inference.pretrained", "load_offloaded", "load_streamed"),
])
def test_old_names_warn_exactly_once_and_are_the_new_objects(module, old, new):
    mod = importlib.import_module(module)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        first = getattr(mod, old)
        exec(f"from {module} import {old} as again", {})
        second = getattr(mod, old)
    assert first is second is getattr(mod, new)
    assert _deprecations(record) == [f"{module}.{old} is deprecated and will be removed in the next "
                                     f"release; use {module}.{new}"]
    assert record[0].filename == __file__     # points at the caller


def test_unknown_names_still_raise_attribute_error():
    with pytest.raises(AttributeError, match="'deepnvme.inference' has no attribute 'nope'"):
        inf.nope   # noqa: B018


def test_old_spellings_run_the_same_streaming(tmp_path):
    ref = tiny_model("llama", torch.float32)
    ref.save_pretrained(tmp_path / "ckpt")
    ids = prompt()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = inf.load_offloaded(str(tmp_path / "ckpt"), offload_dir=str(tmp_path / "packed"), prefetch=1)
        inf.streamer_of(model).close()
        model = inf.load_offloaded(str(tmp_path / "ckpt"), offload_dir=str(tmp_path / "packed"), prefetch=1)
    messages = _deprecations(record)
    assert len(messages) == 2, messages        # the name and the keyword, once each
    assert "load_offloaded is deprecated" in messages[0] and "offload_dir= is deprecated" in messages[1]
    assert (tmp_path / "packed" / "weights.bin").exists()
    assert torch.equal(greedy(model, ids), greedy(ref, ids))
    inf.streamer_of(model).close()
    stack = tiny_model("gpt2", torch.float32)
    expected = greedy(stack, ids)
    with pytest.warns(DeprecationWarning, match="inference.offload is deprecated"):
        model = inf.offload(stack, str(tmp_path / "w"))
    assert torch.equal(greedy(model, ids), expected)
    inf.streamer_of(model).close()
