"""A swapper removes, when it closes, the directories it created for its files if they are
empty; never one that existed before it, nor one holding anything else."""

import os

import pytest
import torch

from deepnvme.swap import TensorSwapper, _dirs


def test_make_dirs_names_only_the_directories_it_created(tmp_path):
    target = tmp_path / "a" / "b" / "c"
    made = _dirs.make_dirs(str(target))
    assert made == (str(tmp_path / "a"), str(tmp_path / "a" / "b"), str(target))
    assert target.is_dir()
    assert _dirs.make_dirs(str(target)) == ()          # all there already
    assert _dirs.make_dirs(str(target / "d")) == (str(target / "d"),)


def test_remove_made_dirs_stops_at_the_first_that_holds_anything(tmp_path):
    made = _dirs.make_dirs(str(tmp_path / "a" / "b" / "c"))
    (tmp_path / "a" / "note.txt").write_text("the user's")
    _dirs.remove_made_dirs(made)
    assert not (tmp_path / "a" / "b").exists()
    assert (tmp_path / "a" / "note.txt").read_text() == "the user's"
    _dirs.remove_made_dirs(made)                          # again: nothing more goes, no error
    assert (tmp_path / "a").is_dir()


def test_close_removes_the_directories_the_swapper_created(tmp_path):
    target = tmp_path / "swap" / "run"
    s = TensorSwapper(target, buffer_bytes=4096, buffer_count=2)
    s.swap_out("k", torch.ones(1024)).result()
    assert target.is_dir()
    s.close()
    assert os.listdir(tmp_path) == []


def test_close_keeps_a_directory_it_did_not_create_or_that_holds_other_files(tmp_path):
    s = TensorSwapper(tmp_path, buffer_bytes=4096, buffer_count=2)
    s.close()
    assert tmp_path.is_dir() and os.listdir(tmp_path) == []
    target = tmp_path / "made"
    first = TensorSwapper(target, buffer_bytes=4096, buffer_count=2)
    second = TensorSwapper(target, buffer_bytes=4096, buffer_count=2)   # found it there
    first.close()                                # the second's directory is still inside
    assert os.listdir(target) == [os.path.basename(second.directory)]
    second.close()                               # empty now, but the second did not create it
    assert target.is_dir() and os.listdir(target) == []
    third = TensorSwapper(tmp_path / "kept", buffer_bytes=4096, buffer_count=2)
    (tmp_path / "kept" / "user.txt").write_text("x")
    third.close()
    assert os.listdir(tmp_path / "kept") == ["user.txt"]


def test_a_failed_creation_removes_the_directories_it_made(tmp_path, monkeypatch):
    def no_rename(src, dst):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(os, "rename", no_rename)
    with pytest.raises(OSError, match="injected"):
        TensorSwapper(tmp_path / "a" / "b", buffer_bytes=4096, buffer_count=2)
    assert os.listdir(tmp_path) == []
