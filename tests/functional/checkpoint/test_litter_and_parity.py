"""Library saves leave no litter (KeyboardInterrupt, files of dead processes) and behave like
torch.save/torch.load where users expect it: mmap=, file objects, PathLike, symlinks, warnings
once, no NumPy needed."""

from __future__ import annotations

import importlib
import io
import logging
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest
import torch

import deepnvme
from deepnvme.handles.aio import AioHandle
from deepnvme.io import durable as atomic
from deepnvme.memory import pinned

async_mod = importlib.import_module("deepnvme.checkpoint.async_saver")
staging_mod = importlib.import_module("deepnvme.checkpoint._staging")
SRC = str(pathlib.Path(__file__).resolve().parents[3] / "src")


def _state(seed: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((300_000,), seed), "b": torch.arange(10) + int(seed)}


def _temps(directory: pathlib.Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if "deepnvme-tmp" in p.name)


def _interrupt(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("kind", ["save", "save_safetensors", "async_save"])
def test_keyboard_interrupt_during_a_save_removes_the_temporary_file(tmp_path, monkeypatch, kind):
    path = tmp_path / "ck"
    deepnvme.save(_state(1.0), path)
    before = path.read_bytes()
    if kind == "async_save":  # Ctrl-C while the tensors are copied to the staging arena
        monkeypatch.setattr(staging_mod.SnapshotStager, "_copy", _interrupt)
        with async_mod.AsyncCheckpointer() as saver, pytest.raises(KeyboardInterrupt):
            saver.save(_state(2.0), path)
    else:  # Ctrl-C while the tensor bytes are written
        monkeypatch.setattr(AioHandle, "write_many", _interrupt)
        with pytest.raises(KeyboardInterrupt):
            getattr(deepnvme, kind)(_state(2.0), path)
    assert _temps(tmp_path) == []
    assert path.read_bytes() == before  # the previous checkpoint is untouched


def test_a_save_removes_temporary_files_of_dead_processes(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    tag = atomic.host_tag()
    dead = tmp_path / f".other.pt.deepnvme-tmp-{child.pid}-{tag}-abcd1234"
    alive = tmp_path / f".other.pt.deepnvme-tmp-{os.getpid()}-{tag}-abcd1234"
    remote = tmp_path / f".other.pt.deepnvme-tmp-{child.pid}-{'0' * 8 if tag != '0' * 8 else '1' * 8}-ab"
    for p in (dead, alive, remote):
        p.write_bytes(b"partial")
    deepnvme.save(_state(1.0), tmp_path / "ck.pt")
    assert not dead.exists() and alive.exists() and remote.exists()
    assert atomic.clean_temp_files(str(tmp_path), dry_run=True) == []


def test_a_killed_saving_process_leaves_files_the_next_save_removes(tmp_path):
    script = textwrap.dedent("""
        import os, sys, torch, deepnvme
        from deepnvme.handles.aio import AioHandle
        def stop(*args, **kwargs):
            print("writing", flush=True)
            os.kill(os.getpid(), 9)  # dies mid-save, like kill -9
        AioHandle.write_many = stop
        deepnvme.save({"w": torch.ones(1000)}, sys.argv[1])
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "a.pt")],
                          env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == -9 and proc.stdout == "writing\n", proc.stderr
    assert len(_temps(tmp_path)) == 1
    deepnvme.save(_state(1.0), tmp_path / "b.pt")  # the first save of this process here
    assert _temps(tmp_path) == []


_MAKE_TEMP = textwrap.dedent("""
    import os, sys
    from deepnvme.io import durable
    print(os.path.basename(durable.create_temp(sys.argv[1], sys.argv[2])), flush=True)
    if sys.argv[3] == "die":
        os.kill(os.getpid(), 9)  # killed mid-save, like kill -9
    sys.stdin.read()  # a live writer: runs until the test closes its stdin
""")


@pytest.mark.parametrize("kind", ["save", "async_save"])
def test_a_long_running_writer_removes_what_a_later_killed_process_left(tmp_path, kind):
    def save(i: int) -> None:
        if kind == "save":
            deepnvme.save(_state(float(i)), tmp_path / "ck.pt")
        else:
            deepnvme.async_save(_state(float(i)), tmp_path / "ck.pt").wait()

    def spawn(stem: str, fate: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-c", _MAKE_TEMP, str(tmp_path), stem, fate],
                                env={**os.environ, "PYTHONPATH": SRC}, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)

    save(1)  # this process's first save in the directory: nothing to clean yet
    live = spawn("eval.pt", "live")
    try:
        kept = live.stdout.readline().strip()  # type: ignore[union-attr]
        killed = spawn("eval.pt", "die")
        gone = killed.stdout.readline().strip()  # type: ignore[union-attr]
        assert killed.wait(60) == -9
        assert _temps(tmp_path) == sorted([kept, gone])
        save(2)  # a later save of the same long-running process
        assert _temps(tmp_path) == [kept]  # the dead process's file is removed, the live one's kept
    finally:
        live.communicate("", timeout=60)
    assert torch.equal(torch.load(tmp_path / "ck.pt", weights_only=True)["w"], _state(2.0)["w"])


def test_load_mmap_maps_the_file_like_torch(tmp_path):
    path = tmp_path / "ck.pt"
    deepnvme.save(_state(3.0), path)

    def mapped() -> bool:
        with open("/proc/self/maps") as f:
            return str(path) in f.read()

    plain = deepnvme.load(path, mmap=False)
    assert not mapped()
    got = deepnvme.load(path, mmap=True)
    assert mapped()  # the storages live in a mapping of the file, as with torch.load(mmap=True)
    assert torch.equal(got["w"], plain["w"]) and torch.equal(got["b"], _state(3.0)["b"])
    del got
    assert torch.equal(deepnvme.load(str(path), mmap=None)["w"], plain["w"])


def test_file_objects_go_to_torch(tmp_path, caplog):
    buf = io.BytesIO()
    with caplog.at_level(logging.DEBUG, logger="deepnvme"):
        deepnvme.save(_state(4.0), buf)
    assert "file object" in caplog.text
    buf.seek(0)
    assert torch.equal(torch.load(buf, weights_only=True)["w"], _state(4.0)["w"])
    buf.seek(0)
    assert torch.equal(deepnvme.load(buf)["b"], _state(4.0)["b"])
    with open(tmp_path / "f.pt", "wb") as f:
        deepnvme.save(_state(5.0), f)
    with open(tmp_path / "f.pt", "rb") as f:
        assert torch.equal(deepnvme.load(f, map_location="cpu")["w"], _state(5.0)["w"])


@pytest.mark.parametrize("call", [
    lambda: deepnvme.save({}, 42), lambda: deepnvme.load(42),
    lambda: deepnvme.save_safetensors({}, io.BytesIO()), lambda: deepnvme.load_safetensors(b"x"),
    lambda: deepnvme.async_save({}, io.BytesIO())])
def test_other_path_types_are_a_clear_type_error(call):
    with pytest.raises(TypeError, match=r"deepnvme\.\w+: path must be a str or os.PathLike"):
        call()


def test_pathlike_everywhere(tmp_path):
    p = tmp_path / "a.pt"
    deepnvme.save(_state(1.0), p)
    assert torch.equal(deepnvme.load(p)["w"], _state(1.0)["w"])
    deepnvme.async_save(_state(2.0), p).wait()
    assert torch.equal(torch.load(p, weights_only=True)["w"], _state(2.0)["w"])
    s = tmp_path / "a.safetensors"
    deepnvme.save_safetensors(_state(6.0), s)
    assert torch.equal(deepnvme.load_safetensors(s)["w"], _state(6.0)["w"])
    assert deepnvme.clean_temp_files(tmp_path) == []


@pytest.mark.parametrize("kind", ["save", "async_save", "save_safetensors", "recycle"])
def test_save_writes_through_a_symlink(tmp_path, kind):
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    target = real_dir / "ck.pt"
    link = tmp_path / "latest.pt"
    link.symlink_to(os.path.relpath(target, tmp_path))  # relative, as `ln -s` users make them
    deepnvme.save(_state(1.0), target)
    for seed in (2.0, 3.0):  # twice: a recycled save overwrites the spare the first one kept
        if kind == "async_save":
            deepnvme.async_save(_state(seed), link).wait()
        elif kind == "save_safetensors":
            deepnvme.save_safetensors(_state(seed), link)
        else:
            deepnvme.save(_state(seed), link, recycle=kind == "recycle")
    assert link.is_symlink() and os.readlink(link) == os.path.relpath(target, tmp_path)
    if kind == "save_safetensors":
        got = deepnvme.load_safetensors(target)
    else:
        got = torch.load(link, weights_only=True)
    assert torch.equal(got["w"], _state(3.0)["w"])
    assert _temps(tmp_path) == [] and _temps(real_dir) == []


def test_a_save_through_a_symlink_removes_what_a_killed_save_left_by_the_target(tmp_path):
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    link = tmp_path / "latest.pt"
    link.symlink_to(real_dir / "ck.pt")
    script = textwrap.dedent("""
        import os, sys, torch, deepnvme
        from deepnvme.handles.aio import AioHandle
        def stop(*args, **kwargs):
            os.kill(os.getpid(), 9)  # dies mid-save, like kill -9
        AioHandle.write_many = stop
        deepnvme.save({"w": torch.ones(1000)}, sys.argv[1])
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(link)], env={**os.environ, "PYTHONPATH": SRC},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert len(_temps(real_dir)) == 1 and _temps(tmp_path) == []  # the temporary file sits by the target
    deepnvme.save(_state(4.0), link)  # this process's first save there
    assert _temps(real_dir) == [] and link.is_symlink()
    assert torch.equal(torch.load(link, weights_only=True)["w"], _state(4.0)["w"])


def test_save_to_a_dangling_symlink_creates_its_target(tmp_path):
    link = tmp_path / "latest.pt"
    link.symlink_to(tmp_path / "new.pt")
    deepnvme.save(_state(7.0), link)
    assert link.is_symlink() and (tmp_path / "new.pt").is_file()
    assert torch.equal(torch.load(tmp_path / "new.pt", weights_only=True)["w"], _state(7.0)["w"])


def test_mlock_fallback_is_one_warning_and_no_log_line(monkeypatch, caplog):
    monkeypatch.setattr(pinned, "_mlock", lambda address, size: 12)  # ENOMEM
    monkeypatch.setattr(pinned, "_warned_mlock", False)
    with caplog.at_level(logging.DEBUG), pytest.warns(RuntimeWarning, match="mlock") as caught:
        a = deepnvme.new_cpu_locked_tensor(5000, torch.float32)
        b = deepnvme.new_cpu_locked_tensor(5000, torch.float32)
    assert len([w for w in caught if "mlock" in str(w.message)]) == 1
    assert "mlock" not in caplog.text
    deepnvme.free_cpu_locked_tensor(a)
    deepnvme.free_cpu_locked_tensor(b)


def test_stale_swap_directories_are_one_warning_and_no_log_line(tmp_path, caplog):
    script = ("import os, torch; from deepnvme.swap import TensorSwapper; "
              f"s = TensorSwapper({str(tmp_path)!r}, min_swap_bytes=0); "
              "s.swap_out('a', torch.zeros(1000)).result(); os._exit(1)")
    subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": SRC},
                   capture_output=True, timeout=120)  # a crash leaves its swap directory
    with caplog.at_level(logging.DEBUG), pytest.warns(RuntimeWarning, match="stale swap"):
        s = deepnvme.TensorSwapper(tmp_path)
    s.close()
    assert "stale swap" not in caplog.text


def test_no_numpy_warning_or_error_without_numpy(tmp_path):
    script = textwrap.dedent("""
        import sys
        sys.modules["numpy"] = None  # as if NumPy were not installed
        import deepnvme, torch
        state = {"big": torch.randn(1 << 18), "a": torch.arange(5), "b": torch.ones(3)}
        d = sys.argv[1]
        deepnvme.save(state, d + "/a.pt")
        assert torch.equal(deepnvme.load(d + "/a.pt")["a"], state["a"])
        deepnvme.async_save(state, d + "/b.pt").wait()
        assert torch.equal(deepnvme.load(d + "/b.pt", mmap=True)["b"], state["b"])
        deepnvme.save_safetensors(state, d + "/c.safetensors")
        assert torch.equal(deepnvme.load_safetensors(d + "/c.safetensors")["big"], state["big"])
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-W", "error", "-c", script, str(tmp_path)],
                          env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr
    assert "NumPy" not in proc.stderr


def test_dcp_round_trip_without_numpy(tmp_path):
    """The DCP reader parses saved items without NumPy (the base install has none)."""
    script = textwrap.dedent("""
        import sys, warnings
        sys.modules["numpy"] = None  # as if NumPy were not installed
        warnings.simplefilter("ignore")  # DCP's single-process notice, not what is tested here
        import torch, torch.distributed.checkpoint as dcp
        from deepnvme.dcp import NVMeStorageReader, NVMeStorageWriter
        state = {"w": torch.randn(1000), "n": torch.arange(7)}
        dcp.save(state, storage_writer=NVMeStorageWriter(sys.argv[1]), no_dist=True)
        target = {"w": torch.zeros(1000), "n": torch.zeros(7, dtype=torch.int64)}
        dcp.load(target, storage_reader=NVMeStorageReader(sys.argv[1]), no_dist=True)
        assert torch.equal(target["w"], state["w"]) and torch.equal(target["n"], state["n"])
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "ck")],
                          env={**os.environ, "PYTHONPATH": SRC}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0 and proc.stdout == "ok\n", proc.stderr
