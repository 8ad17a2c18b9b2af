"""Stale swap directories on a real filesystem."""

import json
import os
import subprocess
import sys

from deepnvme.swap import _dirs


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_find_stale_dirs(tmp_path):
    live = _dirs.create_private_dir(str(tmp_path))
    dead = tmp_path / f"{_dirs.PREFIX}dead"
    dead.mkdir()
    (dead / _dirs.OWNER_FILE).write_text(json.dumps(
        {"host": _dirs.current_owner().host, "pid": _dead_pid(), "start_ticks": None}))
    broken = tmp_path / f"{_dirs.PREFIX}broken"
    broken.mkdir()  # no owner file: crashed while being created
    (tmp_path / "unrelated").mkdir()
    assert _dirs.find_stale_dirs(str(tmp_path)) == sorted([str(dead), str(broken)])
    assert os.path.isdir(live)
    assert _dirs.find_stale_dirs(str(tmp_path / "missing")) == []
    _dirs.remove_dir(str(dead))
    assert not dead.exists()


def test_a_swap_dir_appears_only_with_its_owner_file(tmp_path, monkeypatch):
    seen = []
    real_rename = os.rename

    def rename(src, dst):
        seen.append((os.path.basename(src), os.path.exists(os.path.join(src, _dirs.OWNER_FILE))))
        assert not os.path.exists(dst)
        return real_rename(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    path = _dirs.create_private_dir(str(tmp_path))
    assert len(seen) == 1 and seen[0][0].startswith(_dirs.CREATING_PREFIX) and seen[0][1]
    assert os.path.basename(path).startswith(_dirs.PREFIX)
    assert _dirs.read_owner(path) == _dirs.current_owner()
    assert os.listdir(tmp_path) == [os.path.basename(path)]


def test_creating_dirs_are_stale_only_after_the_grace_period(tmp_path):
    young = tmp_path / f"{_dirs.CREATING_PREFIX}123-aaaa"
    young.mkdir()  # another process is creating it right now: leave it alone
    old = tmp_path / f"{_dirs.CREATING_PREFIX}456-bbbb"
    old.mkdir()
    long_ago = os.stat(old).st_mtime - _dirs.CREATING_GRACE_S - 5
    os.utime(old, (long_ago, long_ago))
    assert _dirs.find_stale_dirs(str(tmp_path)) == [str(old)]


def test_failed_creation_leaves_nothing(tmp_path, monkeypatch):
    def no_rename(src, dst):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(os, "rename", no_rename)
    try:
        _dirs.create_private_dir(str(tmp_path))
    except OSError as exc:
        assert exc.errno == 28
    else:
        raise AssertionError("create_private_dir did not fail")
    assert os.listdir(tmp_path) == []
