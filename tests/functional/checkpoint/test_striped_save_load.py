"""deepnvme.save/load of one torch.save file striped over a volume, and its join/split."""

from __future__ import annotations

import os

import pytest
import torch

import deepnvme
from deepnvme import Volume, VolumeLayoutError


def _state():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(300, 257, generator=g), "b": torch.arange(7, dtype=torch.int16),
            "e": torch.empty(0), "h": torch.randn(33, generator=g).to(torch.bfloat16), "step": 5}


def _same(a, b):
    assert a.keys() == b.keys() and a["step"] == b["step"]
    for k in ("w", "b", "e", "h"):
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])


def test_save_load_striped_replace_and_refuse_other_stripe(tmp_path):
    vol = Volume([tmp_path / "a", tmp_path / "b", tmp_path / "c"], stripe="16K")
    deepnvme.save(_state(), vol / "ckpt" / "model.pt")
    _same(deepnvme.load(vol / "ckpt" / "model.pt"), _state())
    # every drive holds a part; no temporary file or skeleton is left
    for d in "abc":
        names = sorted(os.listdir(tmp_path / d / "ckpt"))
        assert names == [f"model.pt.part{'abc'.index(d)}", "model.pt.volume.json"], names
    deepnvme.save({"x": torch.ones(3)}, vol / "ckpt" / "model.pt")  # replaces it
    assert torch.equal(deepnvme.load(vol / "ckpt" / "model.pt")["x"], torch.ones(3))
    with pytest.raises(VolumeLayoutError, match="stripe"):
        deepnvme.load(Volume(vol.paths, stripe="8K") / "ckpt" / "model.pt")


def test_join_gives_a_file_torch_loads_and_split_round_trips(tmp_path):
    from deepnvme.cli.main import main

    vol = Volume([tmp_path / "a", tmp_path / "b"], stripe="8K")
    deepnvme.save(_state(), vol / "model.pt")
    drives = ["--drives", str(tmp_path / "a"), str(tmp_path / "b"), "--stripe", "8K"]
    plain = str(tmp_path / "plain.pt")
    assert main(["volume", "join", "model.pt", plain, *drives]) == 0
    _same(torch.load(plain, weights_only=True), _state())
    assert main(["volume", "split", plain, "again.pt", *drives]) == 0
    _same(deepnvme.load(vol / "again.pt"), _state())
    with open(plain, "rb") as f:
        whole = f.read()
    back = torch.empty(len(whole), dtype=torch.uint8)
    with deepnvme.AioHandle() as h:
        h.sync_pread(back, vol / "again.pt")
    assert bytes(back.numpy()) == whole
    # the wrong drive order is refused, naming the drive
    swapped = ["--drives", str(tmp_path / "b"), str(tmp_path / "a"), "--stripe", "8K"]
    assert main(["volume", "join", "model.pt", str(tmp_path / "x.pt"), *swapped]) != 0
    assert not os.path.exists(tmp_path / "x.pt")


def test_the_volume_command_takes_its_drives_from_deepnvme_volume(tmp_path, monkeypatch, capsys):
    from deepnvme.cli.main import main

    vol = Volume([tmp_path / "a", tmp_path / "b"], stripe="8K")
    deepnvme.save(_state(), vol / "model.pt")
    monkeypatch.delenv("DEEPNVME_VOLUME", raising=False)
    with pytest.raises(SystemExit, match="DEEPNVME_VOLUME"):
        main(["volume", "join", "model.pt", str(tmp_path / "p.pt")])
    monkeypatch.setenv("DEEPNVME_VOLUME", os.pathsep.join([str(tmp_path / "a"), str(tmp_path / "b")]))
    monkeypatch.setenv("DEEPNVME_VOLUME_STRIPE", "8K")
    assert Volume.from_env() == vol
    assert main(["volume", "join", "model.pt", str(tmp_path / "p.pt")]) == 0
    assert "2 drives" in capsys.readouterr().out
    _same(torch.load(tmp_path / "p.pt", weights_only=True), _state())
    monkeypatch.setenv("DEEPNVME_VOLUME_STRIPE", "1000")  # not a multiple of 4096: named
    with pytest.raises(deepnvme.errors.ConfigError, match="DEEPNVME_VOLUME_STRIPE='1000'"):
        Volume.from_env()
    assert Volume.from_env({"DEEPNVME_VOLUME": " "}) is None
