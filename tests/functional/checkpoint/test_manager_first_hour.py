"""What a new user of CheckpointManager meets first: a damaged ``data.pkl`` under ``deepnvme
verify``, a partial restore, reading without writing, and ``load()``'s entries."""

from __future__ import annotations

import os
import struct
import zipfile

import pytest
import torch

import deepnvme
from deepnvme.checkpoint.manager import RNG_KEY
from deepnvme.checkpoint.manager._lock import LOCK_NAME
from deepnvme.checkpoint.manager._steps import FILE, step_dir
from deepnvme.cli.main import main


def _pickle_span(path: str) -> tuple[int, bytes]:
    """File offset and bytes of the ``data.pkl`` record (stored, uncompressed) in a torch.save zip."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("/data.pkl"))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
        assert header[:4] == b"PK\x03\x04" and info.compress_type == zipfile.ZIP_STORED
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        start = info.header_offset + 30 + name_len + extra_len
        f.seek(start)
        return start, f.read(info.file_size)


def _damage(path: str, where: int) -> None:
    with open(path, "r+b") as f:
        f.seek(where)
        f.write(b"\xff\xff\xff\xff")


@pytest.mark.parametrize("place", ["a key's text", "the pickle's first bytes"])
def test_verify_reports_a_damaged_pickle_as_one_corrupt_step(tmp_path, capsys, place):
    """Four damaged bytes in data.pkl, no checksums: exit 1 and one line naming the step (was a
    UnicodeDecodeError traceback for damage inside a string), as restore() and load() report."""
    with deepnvme.CheckpointManager(tmp_path, keep=None) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(8, 8), "note": "hello"})
        mgr.save(2, {"model": torch.nn.Linear(8, 8), "note": "hello"})
    path = os.path.join(step_dir(str(tmp_path), 2), FILE)
    start, pickle_bytes = _pickle_span(path)
    _damage(path, start + (pickle_bytes.index(b"weight") if place == "a key's text" else 0))
    assert main(["verify", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    corrupt = [line for line in lines if line.startswith("CORRUPT")]
    assert len(corrupt) == 1 and corrupt[0].startswith("CORRUPT  step 2: checkpoint step 2:"), lines
    assert "data.pkl" in corrupt[0] or "pickle" in corrupt[0], corrupt
    assert any(line.startswith("ok       step 1") for line in lines) and "1 of 2 checkpoints intact" in lines
    reader = deepnvme.CheckpointManager(tmp_path)
    with pytest.raises(deepnvme.CheckpointCorruptError, match="step 2"):
        reader.load()
    with pytest.raises(deepnvme.CheckpointCorruptError, match="step 2"):
        reader.restore({"model": torch.nn.Linear(8, 8), "note": None})
    assert reader.load(1)["note"] == "hello"


def _trained():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 16)).sum().backward()
    opt.step()
    return model, opt


def test_restore_strict_false_restores_the_model_without_its_optimizer(tmp_path):
    model, opt = _trained()
    with deepnvme.CheckpointManager(tmp_path, checksums=True) as mgr:
        mgr.save(5, {"model": model, "opt": opt, "epoch": 3})
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    reader = deepnvme.CheckpointManager(tmp_path)
    with pytest.raises(deepnvme.CheckpointMismatchError, match=r"not in the state \['opt', 'epoch'\].*strict=False"):
        reader.restore({"model": fresh})      # strict (the default): today's error, nothing changed
    assert not torch.equal(fresh[0].weight, model[0].weight)
    state = {"model": fresh, "lr": 0.5}      # "lr" is not in the checkpoint: left as it is
    assert reader.restore(state, strict=False) == 5
    assert state["lr"] == 0.5
    for mine, saved in zip(fresh.state_dict().values(), model.state_dict().values()):
        assert torch.equal(mine, saved)
    # inside a module too: a head the checkpoint lacks keeps its values, as load_state_dict(strict=False)
    bigger = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4), torch.nn.Linear(4, 2))
    head = bigger[2].weight.detach().clone()
    assert reader.restore({"model": bigger}, strict=False) == 5
    assert torch.equal(bigger[0].weight, model[0].weight) and torch.equal(bigger[2].weight, head)
    with pytest.raises(deepnvme.CheckpointMismatchError, match="shapes"):   # shapes still must match
        reader.restore({"model": torch.nn.Sequential(torch.nn.Linear(16, 8))}, strict=False)
    with pytest.raises(deepnvme.CheckpointMismatchError, match="shares no entry"):
        reader.restore({"something": torch.zeros(2)}, strict=False)


def test_reading_creates_neither_the_directory_nor_a_lock_file(tmp_path):
    missing = tmp_path / "never-saved"
    reader = deepnvme.CheckpointManager(missing)
    assert reader.steps() == [] and reader.latest_step() is None
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        reader.load()
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        reader.restore({"x": 0})
    reader.close()
    assert not missing.exists()
    with deepnvme.CheckpointManager(tmp_path / "run") as writer:   # a writer makes both at its first save
        assert not (tmp_path / "run").exists()
        writer.save(1, {"x": torch.ones(4)})
        assert (tmp_path / "run" / LOCK_NAME).exists()
    copied = tmp_path / "copied"   # e.g. checkpoints copied off a training node, without the lock file
    copied.mkdir()
    os.rename(step_dir(str(tmp_path / "run"), 1), step_dir(str(copied), 1))
    with deepnvme.CheckpointManager(copied) as reader:
        assert reader.steps() == [1]
        state = {"x": torch.zeros(4)}
        assert reader.restore(state) == 1 and torch.equal(state["x"], torch.ones(4))
        assert set(reader.load()) == {"x"}
    assert sorted(os.listdir(copied)) == [os.path.basename(step_dir(str(copied), 1))]


def test_load_does_not_hand_back_the_rng_entry(tmp_path):
    with deepnvme.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"x": torch.ones(2), "n": 7})
    loaded = deepnvme.CheckpointManager(tmp_path).load()
    assert set(loaded) == {"x", "n"} and RNG_KEY not in loaded
    assert RNG_KEY in deepnvme.load(os.path.join(step_dir(str(tmp_path), 1), FILE))   # still saved
    torch.manual_seed(1)
    want = torch.rand(3)
    torch.manual_seed(1)
    with deepnvme.CheckpointManager(tmp_path / "rng") as mgr:
        mgr.save(1, {"n": 1})
    torch.rand(5)
    assert mgr.restore({"n": 0}) == 1 and torch.equal(torch.rand(3), want)   # restore() still uses it
