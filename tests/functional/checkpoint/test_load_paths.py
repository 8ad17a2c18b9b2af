"""The load-path choice per device: measured once, cached, forced by the setting, and both
paths load the same bytes (fresh and in place), with read errors naming the file."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

import deepnvme
from deepnvme.checkpoint import _load_path, _load_probe
from deepnvme.checkpoint._load_path import PROBE_SLICE, cache_file, load_paths, lookup, measure
from deepnvme.config import checkpoint_config
from deepnvme.errors import DeepNVMeIOError


@pytest.fixture(autouse=True)
def empty_cache(tmp_path, monkeypatch):
    """Every test starts with no choice made: its own cache folder, nothing remembered."""
    monkeypatch.setenv("DEEPNVME_CACHE_DIR", str(tmp_path / "cache"))
    _load_path.forget()


def _rates(mapped: float) -> dict[str, float]:
    return {"fresh_direct": 1.0, "fresh_mapped": mapped, "into_direct": 1.0, "into_mapped": 0.5}


def test_first_use_measures_once_then_the_cache_answers(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"x" * 4096)
    calls = []

    def fake(path, cfg):
        calls.append(path)
        return _rates(3.0)

    cfg = checkpoint_config(None)
    first = load_paths(str(f), cfg, measure_fn=fake)
    assert (first.fresh, first.into, first.source) == ("mapped", "direct", "measured")
    assert "fresh: mapped 3.00 GB/s vs O_DIRECT 1.00 GB/s -> mapped" in first.reason
    assert load_paths(str(f), cfg, measure_fn=fake) == first and calls == [str(f)]
    with open(cache_file()) as fh:
        stored = json.load(fh)
    assert stored["format"] == "deepnvme-load-paths" and len(stored["devices"]) == 1
    _load_path.forget()  # a new process: the cache file answers, nothing is measured
    again = load_paths(str(f), cfg, measure_fn=fake)
    assert (again.fresh, again.into, again.source) == ("mapped", "direct", "cache") and len(calls) == 1
    assert lookup(str(tmp_path)) == again


def test_setting_and_buffered_config_skip_measuring(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"x")

    def never(path, cfg):
        raise AssertionError("measured")

    forced = load_paths(str(f), checkpoint_config({"load_path": "mapped"}), measure_fn=never)
    assert (forced.fresh, forced.into, forced.source) == ("mapped", "mapped", "setting")
    buffered = load_paths(str(f), checkpoint_config({"o_direct": False}), measure_fn=never)
    assert (buffered.fresh, buffered.into) == ("direct", "direct")


def test_small_file_gets_direct_uncached(tmp_path):
    f = tmp_path / "x.bin"
    f.write_bytes(b"x" * 4096)
    got = load_paths(str(f), checkpoint_config(None))
    assert (got.fresh, got.into, got.source) == ("direct", "direct", "default")
    assert not os.path.exists(cache_file()) and lookup(str(f)) is None


def test_damaged_cache_is_measured_over(tmp_path):
    os.makedirs(os.path.dirname(cache_file()), exist_ok=True)
    with open(cache_file(), "w") as fh:
        fh.write("{not json")
    f = tmp_path / "x.bin"
    f.write_bytes(b"x")
    got = load_paths(str(f), checkpoint_config(None), measure_fn=lambda p, c: _rates(0.5))
    assert got.fresh == "direct" and got.source == "measured"


def test_measure_times_all_four_paths_on_a_real_file(tmp_path):
    f = tmp_path / "big.bin"
    with open(f, "wb") as fh:
        fh.truncate(4 * PROBE_SLICE)
    rates = measure(str(f), checkpoint_config(None))
    assert rates is not None and set(rates) == {"fresh_direct", "fresh_mapped", "into_direct", "into_mapped"}
    assert all(v > 0 for v in rates.values())
    assert measure(str(tmp_path / "big.bin"), checkpoint_config(None)) is not None
    (tmp_path / "small.bin").write_bytes(b"x" * (4 * PROBE_SLICE - 1))
    assert measure(str(tmp_path / "small.bin"), checkpoint_config(None)) is None


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"emb": torch.randn(301, 77, generator=g).to(torch.bfloat16),
            "w": torch.randn(1000, 33, generator=g), "b": torch.randn(7, generator=g).half(),
            "n": torch.arange(10, dtype=torch.int64), "empty": torch.empty(0, 3)}


@pytest.mark.parametrize("path", ["direct", "mapped"])
def test_both_paths_load_the_same_bytes(tmp_path, path):
    sd = _state()
    st, pt = str(tmp_path / "m.safetensors"), str(tmp_path / "m.pt")
    save_file(sd, st)
    torch.save(sd, pt)
    cfg = {"load_path": path}
    for got in (deepnvme.load_safetensors(st, config=cfg), deepnvme.load(pt, config=cfg)):
        assert got.keys() == sd.keys()
        assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in sd.items())
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    target["w"] = torch.zeros(1000, 33, dtype=torch.float64)      # dtype conversion
    target["emb"] = torch.zeros(77, 301, dtype=torch.bfloat16).t()  # a strided target
    deepnvme.load_into(target, st, config=cfg)
    assert all(torch.equal(target[k], sd[k].to(target[k].dtype)) for k in sd)


def test_mapped_into_a_file_that_shrank_names_it(tmp_path):
    sd = {"a": torch.ones(1 << 20), "b": torch.ones(1 << 20)}
    st = str(tmp_path / "m.safetensors")
    save_file(sd, st)
    index = deepnvme.checkpoint.inplace.tensor_index(st)
    os.truncate(st, os.path.getsize(st) - (2 << 20))
    from deepnvme.checkpoint._fill_plan import Fill
    from deepnvme.checkpoint._mapped_fill import fill_mapped
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    fills = [Fill(k, index.tensors[k], "direct") for k in sd]
    with pytest.raises(DeepNVMeIOError, match="m.safetensors.*offset") as info:
        fill_mapped(fills, target, threads=2)
    assert info.value.path == st and info.value.offset == index.tensors["b"].offset
    from deepnvme.checkpoint._fresh import read_fresh
    with pytest.raises(DeepNVMeIOError, match="short read"):
        read_fresh(dict(index.tensors), "mapped", checkpoint_config(None))
    with pytest.raises(DeepNVMeIOError):
        read_fresh(dict(index.tensors), "direct", checkpoint_config(None))


@pytest.mark.parametrize("kind", ["fresh_direct", "fresh_mapped", "into_direct", "into_mapped"])
def test_the_whole_file_probe_loads_each_way(tmp_path, kind):
    path = str(tmp_path / "probe.safetensors")
    save_file({f"t{i}": torch.full((1 << 20,), i, dtype=torch.uint8) for i in range(3)}, path)
    assert _load_probe.run(path, kind, 3, 1 << 20) > 0
    with pytest.raises(ValueError, match="holds 3 tensors, expected 4|t3"):
        _load_probe.run(path, kind, 4, 1 << 20)


def test_whole_file_timings_run_in_fresh_processes_and_name_a_failing_probe(tmp_path):
    path = str(tmp_path / "probe.safetensors")
    save_file({f"t{i}": torch.zeros(1 << 20, dtype=torch.uint8) for i in range(2)}, path)
    rates = _load_probe.measure_whole(path, 2, 1 << 20, rounds=1)
    assert set(rates) == {"fresh_direct", "fresh_mapped", "into_direct", "into_mapped"}
    assert all(v > 0 for v in rates.values())
    with pytest.raises(deepnvme.DeepNVMeError, match=r"load probe fresh_direct of .*probe.safetensors.* failed"):
        _load_probe.measure_whole(path, 5, 1 << 20, rounds=1)
