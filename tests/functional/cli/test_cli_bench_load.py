"""``deepnvme bench load PATH`` run for real on tiny checkpoints (--reps 1, fadvise eviction)."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import deepnvme
from deepnvme.bench import _load_readers, _reading
from deepnvme.bench._reading import evict

FAST = ("--reps", "1", "--evict", "fadvise")


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.randn(256, 256), "b": torch.arange(1000, dtype=torch.int64),
            "h": torch.randn(64, 64).to(torch.bfloat16)}


@pytest.fixture
def st_file(tmp_path) -> str:
    path = str(tmp_path / "weights.bin")  # named .bin on purpose: detected by content
    deepnvme.save_safetensors(_state(), path)
    return path


@pytest.fixture
def pt_file(tmp_path) -> str:
    path = str(tmp_path / "model.ckpt")
    w = torch.randn(300, 300)
    torch.save({"model": {"w": w, "w_t": w.t(), "slice": w[10:20]}, "step": [torch.tensor(3)]}, path)
    return path


def _load_json(run_cli, *argv: str) -> dict:
    code, out, err = run_cli("bench", "load", *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def _check_common(data: dict, reps: int = 1) -> None:
    assert data["GB"] == "1e9 bytes" and data["reps"] == reps and data["device"] == "cpu"
    assert data["eviction"] == "fadvise" and isinstance(data["bytes"], int) and data["bytes"] > 0
    assert data["bytes"] == sum(os.path.getsize(f) for f in data["files"])
    assert data["fastest"] in [r["reader"] for r in data["readers"]]
    for r in data["readers"]:
        assert isinstance(r["call"], str) and r["cache"] in ("cold", "warm", "mixed")
        assert len(r["runs"]) == reps and r["ratio_to_fastest"] >= 1.0
        for run in r["runs"]:
            assert run["seconds"] > 0 and run["cache"] in ("cold", "warm")
            assert run["resident_bytes"] is None or isinstance(run["resident_bytes"], int)
        assert r["GBps"]["min"] == pytest.approx(data["bytes"] / r["seconds"]["max"] / 1e9)
    best = min(data["readers"], key=lambda r: r["seconds"]["median"])
    assert best["reader"] == data["fastest"] and best["ratio_to_fastest"] == 1.0


def test_safetensors_file_json(run_cli, st_file) -> None:
    data = _load_json(run_cli, st_file, *FAST, "--reps", "2")
    _check_common(data, reps=2)
    assert data["format"] == "safetensors" and data["files"] == [st_file]
    assert [r["reader"] for r in data["readers"]] == ["deepnvme", "deepnvme-mmap", "safetensors", "safe_open"]
    assert {r["tensors"] for r in data["readers"]} == {3}
    assert data["readers"][0]["call"] == "deepnvme.load_safetensors"
    assert data["readers"][1]["call"] == "deepnvme.load_safetensors(mmap=True)"
    assert isinstance(data["fastest_vs_next"], float) and data["fastest_vs_next"] >= 1.0


def test_torch_file_json_and_nested_state(run_cli, pt_file) -> None:
    data = _load_json(run_cli, pt_file, *FAST)
    _check_common(data)
    assert data["format"] == "torch"
    assert [r["reader"] for r in data["readers"]] == ["deepnvme", "deepnvme-mmap", "torch.load", "torch.load-mmap"]
    assert {r["tensors"] for r in data["readers"]} == {4}


def test_misnamed_file_is_read_by_content(run_cli, tmp_path) -> None:
    """A torch.save file named *.safetensors: torch.load hands it to safetensors by its name
    and fails; that reader is dropped with a note, deepnvme reads it by content."""
    path = str(tmp_path / "model.safetensors")
    torch.save({"w": torch.randn(10)}, path)
    data = _load_json(run_cli, path, *FAST, "--readers", "deepnvme,torch.load")
    assert data["format"] == "torch" and [r["reader"] for r in data["readers"]] == ["deepnvme"]
    assert any(n.startswith("torch.load failed and was dropped: ") for n in data["notes"])


def test_shards_directory_with_index(run_cli, tmp_path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    deepnvme.save_safetensors({"a": torch.randn(100, 100)}, str(model / "model-00001-of-00002.safetensors"))
    deepnvme.save_safetensors({"b": torch.randn(50)}, str(model / "model-00002-of-00002.safetensors"))
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    deepnvme.save_safetensors({"stray": torch.ones(3)}, str(model / "model-00003-of-00003.safetensors"))
    data = _load_json(run_cli, str(model), *FAST)
    _check_common(data)
    assert [os.path.basename(f) for f in data["files"]] == ["model-00001-of-00002.safetensors",
                                                           "model-00002-of-00002.safetensors"]
    assert {r["tensors"] for r in data["readers"]} == {2}          # the file the index does not name: not read
    assert data["readers"][0]["call"].startswith("deepnvme.load_safetensors")


def test_pytorch_bin_directory(run_cli, tmp_path) -> None:
    torch.save({"w": torch.randn(10)}, str(tmp_path / "pytorch_model.bin"))
    data = _load_json(run_cli, str(tmp_path), *FAST, "--readers", "deepnvme,torch.load")
    assert data["format"] == "torch" and [r["reader"] for r in data["readers"]] == ["deepnvme", "torch.load"]


def test_table_ends_with_the_fastest(run_cli, st_file) -> None:
    code, out, err = run_cli("bench", "load", st_file, *FAST)
    assert code == 0, err
    lines = out.strip().splitlines()
    assert lines[-1].startswith("fastest here: ") and "x the next)" in lines[-1]
    assert "GB/s median" in out and "x fastest" in out and ("cold" in out or "warm" in out)


@pytest.mark.parametrize("make, message", [
    (lambda p: p.write_bytes(b"hello, not a checkpoint"), "neither a .safetensors file nor a torch.save"),
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "holds none of model.safetensors.index.json"),
])
def test_bad_path_is_one_line_exit_2(run_cli, tmp_path, make, message) -> None:
    path = tmp_path / "thing"
    make(path)
    code, out, err = run_cli("bench", "load", str(path), *FAST)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith("deepnvme bench load: error: ") and message in err


def test_index_naming_a_missing_shard(run_cli, tmp_path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"a": "gone.safetensors"}}')
    code, _, err = run_cli("bench", "load", str(tmp_path), *FAST)
    assert code == 2 and "gone.safetensors" in err and len(err.strip().splitlines()) == 1


def test_missing_optional_reader_is_skipped_with_a_note(run_cli, monkeypatch, st_file) -> None:
    for name in ("safetensors", "safetensors.torch"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails as if not installed
    data = _load_json(run_cli, st_file, *FAST)
    assert [r["reader"] for r in data["readers"]] == ["deepnvme", "deepnvme-mmap"]
    assert any(n.startswith("safetensors skipped: safetensors.torch is not installed") for n in data["notes"])
    assert any(n.startswith("safe_open skipped: safetensors is not installed") for n in data["notes"])
    assert data["fastest"] in ("deepnvme", "deepnvme-mmap") and data["fastest_vs_next"] >= 1.0


def test_reader_for_another_format_is_noted(run_cli, pt_file) -> None:
    data = _load_json(run_cli, pt_file, *FAST, "--readers", "torch.load,safetensors")
    assert [r["reader"] for r in data["readers"]] == ["torch.load"]
    assert "safetensors skipped: it does not read torch files" in data["notes"]
    code, _, err = run_cli("bench", "load", pt_file, *FAST, "--readers", "safe_open")
    assert code == 2 and "no reader to time" in err


def test_unknown_reader_is_a_usage_error(run_cli, st_file) -> None:
    code, out, err = run_cli("bench", "load", st_file, "--readers", "deepnvme,fastest")
    assert code == 2 and out == "" and "unknown reader(s) fastest" in err
    assert len(err.strip().splitlines()) == 1


def test_cuda_without_cuda_is_one_line_exit_2(run_cli, monkeypatch, st_file) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = run_cli("bench", "load", st_file, *FAST, "--device", "cuda")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "no CUDA device" in err


def test_unreadable_by_every_reader(run_cli, tmp_path) -> None:
    path = str(tmp_path / "obj.pt")
    torch.save({"w": torch.ones(3), "opaque": _load_readers.Reader}, path)  # weights_only refuses it
    code, _, err = run_cli("bench", "load", path, *FAST)
    assert code == 2 and "no reader could load" in err and "failed and was dropped" in err


def test_no_eviction_is_marked_warm(run_cli, st_file) -> None:
    with open(st_file, "rb") as f:
        f.read()  # now in the page cache
    data = _load_json(run_cli, st_file, "--reps", "1", "--evict", "none", "--readers", "safetensors")
    assert data["eviction"] == "none" and data["readers"][0]["cache"] == "warm"
    assert data["readers"][0]["runs"][0]["resident_bytes"] > 0


def test_reads_are_cold_where_eviction_works_and_marked_warm_where_not(run_cli, monkeypatch, st_file) -> None:
    with open(st_file, "rb") as f:
        f.read()  # in the page cache
    evict((st_file,), "fadvise")
    if _reading.check_cold((st_file,))[0]:
        pytest.skip("this filesystem keeps the file cached after fadvise (tmpfs?)")
    data = _load_json(run_cli, st_file, *FAST, "--readers", "deepnvme,safetensors")
    assert [r["cache"] for r in data["readers"]] == ["cold", "cold"]
    assert not any("warm" in n for n in data["notes"])
    monkeypatch.setattr(_reading, "evict_page_cache", lambda path: None)  # eviction has no effect
    data = _load_json(run_cli, st_file, *FAST, "--readers", "deepnvme,safetensors")
    assert [r["cache"] for r in data["readers"]] == ["warm", "warm"]
    assert all(r["runs"][0]["resident_bytes"] > 0 for r in data["readers"])
    assert any(n.startswith("some reads were warm") for n in data["notes"])
    code, out, _ = run_cli("bench", "load", st_file, *FAST, "--readers", "deepnvme,safetensors")
    assert code == 0 and "note: some reads were warm" in out
    cells = [[c.strip() for c in line.split("\u2502")] for line in out.splitlines()]   # table rows: "│ a │ b │"
    assert [row[2] for row in cells if len(row) > 2 and row[1] in ("deepnvme", "safetensors")] == ["warm", "warm"]
    assert out.strip().splitlines()[-1].startswith("fastest here: ")


def test_fadvise_eviction_reads_cold_on_a_disk(st_file) -> None:
    """On a real filesystem (not tmpfs) fadvise empties the cache and the check sees it."""
    with open(st_file, "rb") as f:
        f.read()
    assert _reading.check_cold((st_file,))[1] == "warm"
    assert evict((st_file,), "fadvise") == "fadvise"
    resident, state = _reading.check_cold((st_file,))
    if resident:
        pytest.skip(f"this filesystem keeps {resident} bytes cached after fadvise (tmpfs?)")
    assert state == "cold"


def test_drop_caches_falls_back_to_fadvise(st_file) -> None:
    calls = []
    assert evict((st_file,), "drop-caches", drop=lambda: calls.append(1)) == "drop-caches" and calls

    def refused() -> None:
        raise PermissionError(13, "Permission denied")
    assert evict((st_file,), "drop-caches", drop=refused) == "fadvise"
    assert evict((st_file,), "none") == "none"


def test_resident_bytes_of_an_empty_and_a_missing_file(tmp_path) -> None:
    from deepnvme.io.posix import resident_bytes
    (tmp_path / "empty").write_bytes(b"")
    assert resident_bytes(str(tmp_path / "empty")) == 0
    with pytest.raises(FileNotFoundError):
        resident_bytes(str(tmp_path / "missing"))
