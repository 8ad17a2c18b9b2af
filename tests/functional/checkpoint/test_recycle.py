"""recycle=True: the replaced checkpoint becomes the spare that the next save overwrites."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import deepnvme
from deepnvme.io import durable as atomic
from deepnvme.io.posix import Posix, injected


def _state(n: int, fill: float) -> dict:
    g = torch.Generator().manual_seed(int(fill))
    return {"big": torch.randn(n, generator=g), "small": torch.full((7,), fill),
            "half": torch.randn(3, 5, generator=g).half(), "step": int(fill)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@pytest.mark.parametrize("sizes", [(300_000, 200_000, 100_000), (100_000, 200_000, 300_000)],
                         ids=["shrinking", "growing"])
def test_saves_overwrite_the_spare_and_match_a_fresh_save(tmp_path, sizes):
    path, spare = tmp_path / "ck.pt", atomic.spare_name(str(tmp_path / "ck.pt"))
    inodes = []
    for i, n in enumerate(sizes):
        state = _state(n, float(i + 1))
        deepnvme.save(state, path, recycle=True)
        inodes.append(os.stat(path).st_ino)
        assert _same(torch.load(path, weights_only=True), state)
        fresh = tmp_path / f"fresh{i}.pt"
        deepnvme.save(state, fresh)
        assert path.read_bytes() == fresh.read_bytes()  # no stale byte of an older checkpoint
    assert os.stat(spare).st_ino == inodes[1]  # the second save's file waits as the spare
    assert inodes[2] == inodes[0]  # the third save overwrote the first save's file
    atomic.wait_for_releases()
    assert atomic.clean_temp_files(str(tmp_path)) == []  # a spare is not a crash leftover


def test_async_save_recycles_too(tmp_path):
    path = tmp_path / "ck.pt"
    with deepnvme.AsyncCheckpointer() as ck:
        inodes = []
        for i in range(3):
            state = _state(100_000, float(i))
            h = ck.save(state, path, recycle=True)
            state["big"].zero_()
            h.wait()
            inodes.append(os.stat(path).st_ino)
            back = torch.load(path, weights_only=True)
            assert torch.equal(back["big"], _state(100_000, float(i))["big"])
    assert inodes[2] == inodes[0]
    assert os.stat(atomic.spare_name(str(path))).st_ino == inodes[1]


class _TempFilesFull(Posix):
    """Writes to temporary files (a taken spare included) fail with ENOSPC."""

    def pwritev(self, fd, buffers, offset):
        if ".deepnvme-tmp-" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwritev(fd, buffers, offset)


def test_failed_recycled_save_keeps_the_previous_checkpoint(tmp_path):
    path = tmp_path / "ck.pt"
    deepnvme.save(_state(1000, 1.0), path, recycle=True)
    deepnvme.save(_state(1000, 2.0), path, recycle=True)
    disk = _TempFilesFull()
    with pytest.raises(OSError) as info:
        with injected(disk):
            deepnvme.save(_state(1000, 3.0), path, recycle=True)
    assert info.value.errno == errno.ENOSPC
    assert _same(torch.load(path, weights_only=True), _state(1000, 2.0))
    assert sorted(os.listdir(tmp_path)) == ["ck.pt"]  # the spare was used up, nothing left over
    deepnvme.save(_state(1000, 4.0), path, recycle=True)  # and saving goes on
    assert _same(deepnvme.load(path), _state(1000, 4.0))


def test_take_spare_without_a_spare_is_none(tmp_path):
    assert atomic.take_spare(str(tmp_path / "none.pt")) is None


def test_no_hard_links_means_no_spare_but_the_save_succeeds(tmp_path, monkeypatch, caplog):
    path = tmp_path / "ck.pt"
    deepnvme.save(_state(1000, 1.0), path, recycle=True)

    def no_links(src, dst):
        raise OSError(errno.EPERM, "hard links not supported here")

    monkeypatch.setattr(os, "link", no_links)
    deepnvme.save(_state(1000, 2.0), path, recycle=True)
    assert _same(deepnvme.load(path), _state(1000, 2.0))
    assert "cannot keep" in caplog.text
    atomic.wait_for_releases()
    assert sorted(os.listdir(tmp_path)) == ["ck.pt"]


def test_without_recycle_an_mmapped_older_version_never_changes(tmp_path):
    path = tmp_path / "ck.pt"
    first = _state(50_000, 1.0)
    deepnvme.save(first, path)
    mapped = torch.load(path, weights_only=True, mmap=True)
    for i in range(2, 5):
        deepnvme.save(_state(50_000, float(i)), path)
    atomic.wait_for_releases()
    assert _same(mapped, first)  # the replaced inode lives on, untouched, while mapped
