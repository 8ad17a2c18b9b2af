"""deepnvme.bench.checkpoint_size on real checkpoints: a file, a CheckpointManager folder (its
latest committed step), any other folder, and what it refuses."""

from __future__ import annotations

import os

import pytest
import torch

import deepnvme
from deepnvme.bench import checkpoint_size
from deepnvme.errors import UsageError


def _bytes_under(path) -> int:
    return sum(os.path.getsize(os.path.join(r, n)) for r, _, names in os.walk(path) for n in names)


def test_a_file_is_its_size(tmp_path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"w": torch.randn(100)}, path)
    size = checkpoint_size(str(path))
    assert (size.nbytes, size.files, size.step) == (path.stat().st_size, 1, None)
    assert size.gb == pytest.approx(path.stat().st_size / 1e9)


def test_a_manager_folder_is_its_latest_committed_step(tmp_path) -> None:
    mgr = deepnvme.CheckpointManager(str(tmp_path), keep=3)
    mgr.save(1, {"w": torch.randn(1000)})
    mgr.save(7, {"w": torch.randn(5000), "b": torch.randn(10)})
    mgr.wait()
    mgr.close()
    latest = next(p for p in tmp_path.iterdir() if p.name.startswith("step-") and p.name.endswith("7"))
    size = checkpoint_size(str(tmp_path))
    assert size.step == 7 and size.path == str(latest)
    assert size.nbytes == _bytes_under(latest) > 5000 * 4
    assert size.files == sum(len(names) for _, _, names in os.walk(latest))
    (tmp_path / "step-9").mkdir()  # no manifest: not committed, not the latest step
    (tmp_path / "step-9" / "state.pt").write_bytes(b"x" * 10)
    assert checkpoint_size(str(tmp_path)).step == 7
    alone = checkpoint_size(str(latest))  # one step folder: its files
    assert (alone.step, alone.nbytes) == (None, size.nbytes)


def test_another_folder_counts_every_file_but_hidden_ones(tmp_path) -> None:
    deepnvme.save_safetensors({"a": torch.randn(64)}, str(tmp_path / "model-1.safetensors"))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "extra.bin").write_bytes(b"y" * 300)
    (tmp_path / ".model.safetensors.deepnvme-tmp-1-abc").write_bytes(b"z" * 10_000)  # a write in progress
    size = checkpoint_size(str(tmp_path))
    assert size.files == 2 and size.step is None
    assert size.nbytes == (tmp_path / "model-1.safetensors").stat().st_size + 300


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_bytes(b""), "is an empty file"),
    (lambda p: p.mkdir(), "holds no data"),
    (lambda p: (p / "step-3").mkdir(parents=True), "no committed step"),
])
def test_nothing_to_size_is_a_usage_error(tmp_path, make, message) -> None:
    path = tmp_path / "ckpt"
    make(path)
    with pytest.raises(UsageError, match=message):
        checkpoint_size(str(path))
