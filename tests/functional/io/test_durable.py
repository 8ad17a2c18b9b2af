"""atomic.commit: the replaced file is freed in the background; reserve retries after releases."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from deepnvme.errors import DeepNVMeIOError
from deepnvme.io import durable as atomic
from deepnvme.io import file as io_file
from deepnvme.io.posix import Posix

from ...concurrency import run_in_fork


@pytest.fixture
def gated_close(monkeypatch):
    """Replace the background close with one that waits for ``gate``; records the fds closed."""
    gate = threading.Event()
    closed: list[int] = []

    def close(fd: int) -> None:
        assert gate.wait(30), "test never opened the gate"
        os.close(fd)
        closed.append(fd)

    monkeypatch.setattr(atomic, "_close_released", close)
    yield gate, closed
    gate.set()
    atomic.wait_for_releases()


def _write(path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _deleted_fds_of(path) -> list[int]:
    """This process's descriptors that point at the (unlinked) former ``path``."""
    target = f"{os.path.abspath(path)} (deleted)"
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == target:
                found.append(int(name))
        except OSError:
            pass
    return found


def test_commit_returns_before_the_replaced_file_is_freed(tmp_path, gated_close):
    gate, closed = gated_close
    final, tmp = tmp_path / "ckpt.pt", tmp_path / "new.tmp"
    _write(final, b"old" * 1000)
    _write(tmp, b"new")
    atomic.commit(str(tmp), str(final))
    assert final.read_bytes() == b"new" and not tmp.exists()
    held = _deleted_fds_of(final)
    assert len(held) == 1  # the old inode is still alive, held for the background close
    assert os.pread(held[0], 3, 0) == b"old"
    assert closed == []
    gate.set()
    atomic.wait_for_releases()
    assert closed == held and _deleted_fds_of(final) == []


@pytest.mark.parametrize("kind", ["missing", "symlink", "directory"])
def test_commit_holds_only_regular_files(tmp_path, gated_close, kind):
    gate, closed = gated_close
    final, tmp = tmp_path / "ckpt.pt", tmp_path / "new.tmp"
    other = tmp_path / "other.pt"
    _write(other, b"kept")
    if kind == "symlink":
        final.symlink_to(other)
    elif kind == "directory":
        final.mkdir()
    _write(tmp, b"new")
    if kind == "directory":
        with pytest.raises(OSError):
            atomic.commit(str(tmp), str(final))
    else:
        atomic.commit(str(tmp), str(final))
        assert final.read_bytes() == b"new" and not final.is_symlink()
    assert other.read_bytes() == b"kept"  # a symlink's target is not the replaced file
    gate.set()
    atomic.wait_for_releases()
    assert closed == []


class _FullUntilReleased(Posix):
    """fallocate fails with ENOSPC ``failures`` times."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def fallocate(self, fd, offset, length):
        self.calls += 1
        if self.calls <= self.failures:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().fallocate(fd, offset, length)


def test_reserve_waits_for_pending_releases_then_retries(tmp_path, monkeypatch):
    waited = []
    monkeypatch.setattr(atomic, "wait_for_releases", lambda: waited.append(True))
    path = tmp_path / "f"
    path.touch()
    posix = _FullUntilReleased(failures=1)
    io_file.reserve(str(path), 1 << 20, posix=posix)
    assert waited == [True] and posix.calls == 2
    assert os.stat(path).st_size == 1 << 20


def test_reserve_still_full_after_releases_names_the_file(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "wait_for_releases", lambda: None)
    path = tmp_path / "f"
    path.touch()
    with pytest.raises(DeepNVMeIOError) as info:
        io_file.reserve(str(path), 1 << 20, posix=_FullUntilReleased(failures=2))
    assert info.value.errno == errno.ENOSPC
    assert str(path) in str(info.value) and str(1 << 20) in str(info.value)


def test_commit_in_a_forked_child_after_the_parent_released(tmp_path):
    final = tmp_path / "ck.pt"
    for data in (b"one", b"two"):  # the parent's release thread is running now
        tmp = tmp_path / "new.tmp"
        _write(tmp, data)
        atomic.commit(str(tmp), str(final))
    atomic.wait_for_releases()

    def child() -> bool:  # its own release thread, so waiting cannot hang
        tmp = tmp_path / "child.tmp"
        _write(tmp, b"three")
        atomic.commit(str(tmp), str(final))
        atomic.wait_for_releases()
        return final.read_bytes() == b"three"

    assert run_in_fork(child) == 0

