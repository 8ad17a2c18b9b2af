"""save_distributed in a one-process gloo group with injected faults: the previous file and no temp files remain."""

from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.distributed as dist

import deepnvme
from deepnvme.io import durable as atomic


@pytest.fixture
def gloo_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_failed_final_commit_removes_temp_and_keeps_previous(tmp_path, gloo_group, monkeypatch):
    directory = tmp_path / "ck"
    directory.mkdir()
    path = directory / "ck.pt"
    torch.save({"old": torch.ones(3)}, path)

    def failing_fsync(p):
        raise OSError(errno.EIO, "Input/output error (injected fsync)")

    monkeypatch.setattr(atomic, "fsync_path", failing_fsync)
    with pytest.raises(deepnvme.DistributedSaveError) as info:
        deepnvme.save_distributed({"w": torch.randn(10_000)}, path)
    assert isinstance(info.value.__cause__, OSError)
    assert os.listdir(directory) == ["ck.pt"]
    assert torch.equal(torch.load(path, weights_only=True)["old"], torch.ones(3))
