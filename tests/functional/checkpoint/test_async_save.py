"""deepnvme.async_save: snapshot semantics, handles, errors at wait(), bounded in-flight saves."""

from __future__ import annotations

import errno
import logging
import os
import threading
import time

import pytest
import torch

import deepnvme


def test_snapshot_holds_values_at_call_time(tmp_path):
    w = torch.arange(200_000, dtype=torch.float32)
    state = {"w": w, "view": w[5:10], "step": 1}
    h = deepnvme.async_save(state, tmp_path / "ck.pt")
    w.mul_(-1)  # training goes on right away
    h.wait()
    assert h.done()
    back = torch.load(tmp_path / "ck.pt", weights_only=True)
    assert torch.equal(back["w"], torch.arange(200_000, dtype=torch.float32))
    assert back["view"].untyped_storage().data_ptr() == back["w"].untyped_storage().data_ptr()
    assert back["step"] == 1


def test_checkpointer_reuses_arenas_and_bounds_in_flight(tmp_path):
    with deepnvme.AsyncCheckpointer(max_in_flight=2) as ck:
        handles = []
        t = torch.zeros(50_000)
        for i in range(5):
            t.fill_(i)
            handles.append(ck.save({"t": t, "i": i}, tmp_path / f"ck{i}.pt"))
            assert len(ck._stager._pool.arenas()) == 2
        ck.wait_all()
        for i, h in enumerate(handles):
            assert h.done()
            back = deepnvme.load(tmp_path / f"ck{i}.pt")
            assert back["i"] == i and torch.equal(back["t"], torch.full((50_000,), float(i)))
    assert sorted(os.listdir(tmp_path)) == [f"ck{i}.pt" for i in range(5)]


def test_error_is_raised_at_wait_and_temp_removed(tmp_path):
    target = tmp_path / "is_a_dir"
    target.mkdir()
    (target / "x").write_text("keeps the rename from replacing it")
    with deepnvme.AsyncCheckpointer() as ck:
        h = ck.save({"a": torch.ones(10)}, target)
        with pytest.raises(OSError):
            h.wait()
        assert h.done()
        ok = ck.save({"a": torch.ones(10)}, tmp_path / "ok.pt")  # the saver keeps working
        ok.wait()
    assert sorted(os.listdir(tmp_path)) == ["is_a_dir", "ok.pt"]


def test_missing_directory_fails_at_call(tmp_path):
    with deepnvme.AsyncCheckpointer() as ck:
        with pytest.raises(OSError):
            ck.save({"a": torch.ones(1)}, tmp_path / "nope" / "ck.pt")


def test_background_thread_does_the_writing(tmp_path):
    seen = []
    from deepnvme.handles.aio import AioHandle
    real = AioHandle.write_many

    def spy(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return real(*args, **kwargs)

    AioHandle.write_many = spy
    try:
        with deepnvme.AsyncCheckpointer() as ck:
            ck.save({"a": torch.ones(1000)}, tmp_path / "ck.pt").wait()
    finally:
        AioHandle.write_many = real
    assert seen == ["deepnvme-async-save"]


def _enospc_once(monkeypatch):
    """The first background reserve fails with ENOSPC; later ones work."""
    from deepnvme.checkpoint import _writer
    real, calls = _writer.reserve, []

    def reserve(path, size, **kwargs):
        calls.append(path)
        if len(calls) == 1:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return real(path, size, **kwargs)

    monkeypatch.setattr(_writer, "reserve", reserve)


def _wait_done(handle, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not handle.done():
        assert time.monotonic() < deadline, "save did not finish"
        time.sleep(0.01)


def test_failure_not_waited_for_is_raised_by_wait_all(tmp_path, monkeypatch):
    _enospc_once(monkeypatch)
    with deepnvme.AsyncCheckpointer(max_in_flight=2) as ck:
        _wait_done(ck.save({"w": torch.randn(1000)}, tmp_path / "step1.pt"))  # handle dropped
        ck.save({"w": torch.randn(1000)}, tmp_path / "step2.pt")
        with pytest.raises(OSError) as info:
            ck.wait_all()
        assert info.value.errno == errno.ENOSPC
        ck.wait_all()  # each error is raised once
    assert sorted(os.listdir(tmp_path)) == ["step2.pt"]


def test_close_logs_a_failure_nobody_waited_for(tmp_path, monkeypatch, caplog):
    _enospc_once(monkeypatch)
    ck = deepnvme.AsyncCheckpointer()
    _wait_done(ck.save({"w": torch.randn(1000)}, tmp_path / "step1.pt"))
    ck.save({"w": torch.randn(1000)}, tmp_path / "step2.pt")
    with caplog.at_level(logging.ERROR, logger="deepnvme"):
        ck.close()
    assert "never waited for" in caplog.text and "No space left" in caplog.text


def test_close_during_a_snapshot_fails_that_save_cleanly(tmp_path, monkeypatch):
    import sys
    module = sys.modules["deepnvme.checkpoint._staging"]
    real = module.write_skeleton
    entered, release = threading.Event(), threading.Event()

    def slow_skeleton(obj, tmp):
        entered.set()
        assert release.wait(10)
        return real(obj, tmp)

    monkeypatch.setattr(module, "write_skeleton", slow_skeleton)
    ck = deepnvme.AsyncCheckpointer()
    out = {}

    def save():
        try:
            out["handle"] = ck.save({"w": torch.randn(10)}, tmp_path / "a.pt")
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=save)
    t.start()
    assert entered.wait(10)
    ck.close()  # e.g. atexit, or another thread shutting down
    release.set()
    t.join(10)
    assert isinstance(out.get("error"), RuntimeError), out
    assert os.listdir(tmp_path) == []


def _state(n_big: int, fill: float) -> dict:
    return {f"w{i}": torch.full((n_big + 1000 * i,), fill + i) for i in range(4)} | {
        "tiny": torch.tensor([fill]), "empty": torch.empty(0), "step": int(fill)}


def _check(path, expected: dict) -> None:
    back = torch.load(path, weights_only=True)
    assert back.keys() == expected.keys()
    for k, v in expected.items():
        assert torch.equal(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v


def test_snapshot_reuses_the_arena_and_grows_it(tmp_path, monkeypatch):
    """Saves that fit reuse the arena; a larger one gets a new arena; every file holds the
    values of its call, however the tensors change afterwards."""
    from deepnvme.memory import copy as copy_mod
    monkeypatch.setattr(copy_mod, "_PIECE", 4096)  # many pieces, shared among threads
    with deepnvme.AsyncCheckpointer() as ck:
        arenas = []
        for i, (n, fill) in enumerate([(100_000, 1.0), (100_000, 2.0), (300_000, 3.0),
                                       (50_000, 4.0)]):
            state = _state(n, fill)
            h = ck.save(state, tmp_path / f"c{i}.pt")
            expected = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                        for k, v in state.items()}
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    v.fill_(-7)  # training mutates right after the call
            h.wait()
            _check(tmp_path / f"c{i}.pt", expected)
            arena = ck._stager._pool.arenas()[0]
            arenas.append((arena.data_ptr(), arena.numel()))
        assert arenas[1] == arenas[0] and arenas[3] == arenas[2]  # reused
        assert arenas[2][1] > arenas[1][1]  # grown for the larger checkpoint


def test_failed_arena_growth_gives_back_no_freed_arena(tmp_path, monkeypatch):
    module = __import__("sys").modules["deepnvme.checkpoint._arena"]
    with deepnvme.AsyncCheckpointer() as ck:
        ck.save(_state(1000, 1.0), tmp_path / "small.pt").wait()
        real_new = module.new_cpu_locked_tensor

        def no_memory(*args, **kwargs):
            raise MemoryError("injected: cannot lock that much")

        monkeypatch.setattr(module, "new_cpu_locked_tensor", no_memory)
        with pytest.raises(MemoryError, match="injected"):
            ck.save(_state(200_000, 2.0), tmp_path / "big.pt")
        assert ck._stager._pool.arenas() == [None]  # the freed arena is not handed out again
        monkeypatch.setattr(module, "new_cpu_locked_tensor", real_new)
        big = _state(200_000, 3.0)
        ck.save(big, tmp_path / "big.pt").wait()
        _check(tmp_path / "big.pt", big)
    assert sorted(os.listdir(tmp_path)) == ["big.pt", "small.pt"]


def test_failed_pickling_keeps_the_checkpointer_usable(tmp_path):
    with deepnvme.AsyncCheckpointer() as ck:
        ck.save(_state(100_000, 1.0), tmp_path / "first.pt").wait()
        bad = {"a": torch.ones(100_000), "fn": lambda: None}  # pickling fails after "a"
        with pytest.raises(Exception):
            ck.save(bad, tmp_path / "bad.pt")
        good = _state(100_000, 2.0)
        ck.save(good, tmp_path / "good.pt").wait()
        _check(tmp_path / "good.pt", good)
    assert sorted(os.listdir(tmp_path)) == ["first.pt", "good.pt"]
