"""CheckpointManager end to end: bitwise round trips in both modes, the interval policy,
retention, the lock, leftovers, ENOSPC and RNG states (the fence: test_manager_fence.py)."""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

import deepnvme
from deepnvme.io.posix import Posix, injected


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _train(model, opt, sched=None, steps=1):
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


def _bits(obj):
    """Every tensor's bytes and every other leaf, for bitwise comparison of state dicts."""
    if isinstance(obj, torch.Tensor):
        return ("t", str(obj.dtype), tuple(obj.shape), obj.contiguous().reshape(-1).view(torch.uint8).tolist()
                if obj.numel() else [])
    if isinstance(obj, dict):
        return {k: _bits(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_bits(v) for v in obj]
    return obj


def _setup(seed=0):
    model = _model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


@pytest.mark.parametrize("mode", ["snapshot", "fenced"])
def test_round_trip_is_bitwise_and_torch_loadable(tmp_path, mode):
    model, opt, sched = _setup()
    _train(model, opt, sched, steps=3)
    extra = torch.arange(10, dtype=torch.int16)
    with deepnvme.CheckpointManager(tmp_path, staging=mode) as mgr:
        state = {"model": model, "opt": opt, "sched": sched, "extra": extra, "epoch": 7,
                 "notes": {"name": "run", "lrs": [0.1, 0.2]}}
        want = {"model": _bits(model.state_dict()), "opt": _bits(opt.state_dict()),
                "sched": _bits(sched.state_dict()), "extra": _bits(extra)}
        assert mgr.save(3, state) is True
        draws = (torch.rand(4), random.random())  # what the saved RNG states produce next
        _train(model, opt, sched, steps=2)  # the fence (or the snapshot) keeps step 3 intact
        extra.add_(1)  # fenced: allowed once the optimizer's step has run
        mgr.wait()
        assert mgr.steps() == [3] and mgr.latest_step() == 3
    plain = torch.load(tmp_path / "step-000000000003" / "state.pt", weights_only=True)
    assert _bits(plain["model"]) == want["model"] and plain["epoch"] == 7

    model2, opt2, sched2 = _setup(seed=1)
    _train(model2, opt2, sched2)
    state2 = {"model": model2, "opt": opt2, "sched": sched2, "extra": torch.zeros(10, dtype=torch.int16),
              "epoch": None, "notes": None}
    reader = deepnvme.CheckpointManager(tmp_path)
    assert reader.restore(state2) == 3
    assert _bits(model2.state_dict()) == want["model"]
    assert _bits(opt2.state_dict()) == want["opt"]
    assert _bits(sched2.state_dict()) == want["sched"]
    assert _bits(state2["extra"]) == want["extra"]
    assert state2["epoch"] == 7 and state2["notes"] == {"name": "run", "lrs": [0.1, 0.2]}
    assert torch.equal(torch.rand(4), draws[0]) and random.random() == draws[1]  # RNG restored
    loaded = reader.load()
    assert set(loaded) == {"model", "opt", "sched", "extra", "epoch", "notes"}   # RNG states: restore()'s
    reader.close()


def test_numpy_rng_state_is_restored(tmp_path):
    np = pytest.importorskip("numpy")
    with deepnvme.CheckpointManager(tmp_path) as mgr:
        mgr.save(0, {"x": 1})
        mgr.wait()
        want = np.random.rand(3)
        mgr.restore({"x": 0})
        assert np.array_equal(np.random.rand(3), want)


def test_fenced_refuses_non_cpu_tensors(tmp_path):
    with deepnvme.CheckpointManager(tmp_path, staging="fenced") as mgr:
        with pytest.raises(ValueError, match="staging='snapshot'"):
            mgr.save(0, {"w": torch.zeros(2, device="meta")})


def test_interval_policy_and_step_order(tmp_path):
    with deepnvme.CheckpointManager(tmp_path, every_steps=3, keep=None) as mgr:
        saved = [s for s in range(1, 10) if mgr.save(s, {"s": s})]
        assert saved == [1, 3, 6, 9]  # the first save of a directory is always due
        assert mgr.save(10, {"s": 10}, force=True)
        with pytest.raises(ValueError, match="not greater than the newest saved step 10"):
            mgr.save(10, {"s": 10})
        with pytest.raises(ValueError, match="not greater"):
            mgr.save(4, {"s": 4}, force=True)
        mgr.wait()
        assert mgr.steps() == [1, 3, 6, 9, 10]
    with deepnvme.CheckpointManager(tmp_path, every_seconds=3600) as mgr:
        assert not mgr.save(11, {"s": 11})  # not first any more, and no hour has passed
        assert mgr.load()["s"] == 10


def test_retention_keeps_newest(tmp_path):
    with deepnvme.CheckpointManager(tmp_path, keep=2) as mgr:
        for s in range(5):
            mgr.save(s, {"w": torch.full((100,), float(s))})
        mgr.wait()
        assert mgr.steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == [".deepnvme-writer.lock", "step-000000000003", "step-000000000004"]
    with deepnvme.CheckpointManager(tmp_path, keep=1) as mgr:
        mgr.save(5, {"w": torch.zeros(1)})
    assert mgr.steps() == [5]


def test_second_writer_gets_a_clear_error_readers_do_not(tmp_path):
    first = deepnvme.CheckpointManager(tmp_path)
    first.save(1, {"a": 1})
    first.wait()
    second = deepnvme.CheckpointManager(tmp_path)
    assert second.steps() == [1] and second.load()["a"] == 1  # reading needs no lock
    with pytest.raises(deepnvme.CheckpointLockedError, match=f"pid {os.getpid()}"):
        second.save(2, {"a": 2})
    first.close()
    second.save(2, {"a": 2})
    second.close()
    assert second.steps() == [1, 2]


def test_lock_of_a_killed_process_does_not_block(tmp_path):
    code = ("import sys, os, deepnvme; m = deepnvme.CheckpointManager(sys.argv[1]); "
            "m.save(1, {'a': 1}); m.wait(); print('locked', flush=True); os.kill(os.getpid(), 9)")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(deepnvme.__file__))})
    assert proc.returncode == -9 and "locked" in proc.stdout
    with deepnvme.CheckpointManager(tmp_path) as mgr:
        assert mgr.save(2, {"a": 2})
    assert mgr.steps() == [1, 2]


def test_leftovers_are_removed_and_logged_when_a_manager_opens(tmp_path, caplog):
    (tmp_path / ".step-000000000009.deepnvme-building-12345-abcd").mkdir()
    (tmp_path / ".step-000000000009.deepnvme-building-12345-abcd" / "state.pt").write_bytes(b"x")
    (tmp_path / ".step-000000000002.deepnvme-deleting-12345-ef01").mkdir()
    (tmp_path / ".deepnvme-writer.lock").write_text("pid 12345 on host\n")   # the killed writer's
    with caplog.at_level(logging.WARNING, logger="deepnvme"):
        mgr = deepnvme.CheckpointManager(tmp_path)
    assert os.listdir(tmp_path) == [".deepnvme-writer.lock"]
    assert caplog.text.count("left by an interrupted save") == 2
    assert mgr.steps() == [] and mgr.latest_step() is None
    mgr.close()


class _FullDisk(Posix):
    """pwritev fails with ENOSPC while ``full`` is set."""

    full = False

    def pwritev(self, fd, buffers, offset):
        if self.full:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwritev(fd, buffers, offset)


@pytest.mark.parametrize("mode", ["snapshot", "fenced"])
def test_enospc_fails_that_save_and_keeps_earlier_ones(tmp_path, mode):
    disk = _FullDisk()
    with injected(disk):
        mgr = deepnvme.CheckpointManager(tmp_path, staging=mode, keep=1)
        mgr.save(1, {"w": torch.ones(1 << 18)})
        mgr.wait()
        disk.full = True
        mgr.save(2, {"w": torch.zeros(1 << 18)})
        with pytest.raises(OSError) as info:
            mgr.wait()
        assert info.value.errno == errno.ENOSPC
        assert "step 2 was not saved" in str(info.value) and "earlier checkpoints are intact" in str(info.value)
        assert mgr.steps() == [1] and torch.equal(mgr.load()["w"], torch.ones(1 << 18))
        assert sorted(os.listdir(tmp_path)) == [".deepnvme-writer.lock", "step-000000000001"]
        disk.full = False
        mgr.save(2, {"w": torch.zeros(1 << 18)})  # the failed step may be saved again
        mgr.close()
    assert mgr.steps() == [2]


def test_failure_is_raised_by_the_next_save(tmp_path):
    disk = _FullDisk()
    with injected(disk):
        mgr = deepnvme.CheckpointManager(tmp_path)
        disk.full = True
        mgr.save(1, {"w": torch.ones(1 << 18)})
        deadline = time.monotonic() + 10
        while not all(j.future.done() for j in mgr._pending):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(OSError, match="step 1 was not saved"):
            mgr.save(2, {"w": torch.ones(1)})
        disk.full = False
        mgr.close()  # the error was reported once; close does not raise it again
    assert mgr.steps() == []


def test_restore_mismatch_changes_nothing(tmp_path):
    with deepnvme.CheckpointManager(tmp_path) as mgr:
        mgr.save(1, {"w": torch.ones(3), "n": 1})
    target = {"w": torch.zeros(4), "n": 0}
    with pytest.raises(deepnvme.CheckpointMismatchError, match="shapes"):
        mgr.restore(target)
    with pytest.raises(deepnvme.CheckpointMismatchError) as info:
        mgr.restore({"w": torch.zeros(3)})
    assert info.value.unexpected_keys == ["n"]
    assert torch.equal(target["w"], torch.zeros(4)) and target["n"] == 0
    with pytest.raises(FileNotFoundError, match="no checkpoint of step 5"):
        mgr.load(5)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="staging"):
        deepnvme.CheckpointManager(tmp_path, staging="eager")
    with pytest.raises(ValueError, match="checksums"):
        deepnvme.CheckpointManager(tmp_path, checksums="md5")
    with deepnvme.CheckpointManager(tmp_path) as mgr:
        with pytest.raises(ValueError, match="reserved|str other than"):
            mgr.save(0, {"_deepnvme_rng": 1})
        with pytest.raises(ValueError, match="int >= 0"):
            mgr.save(-1, {})
    with pytest.raises(RuntimeError, match="closed"):
        mgr.save(5, {})


def test_wait_from_another_thread_sees_commits(tmp_path):
    mgr = deepnvme.CheckpointManager(tmp_path, keep=None)
    for s in range(3):
        mgr.save(s, {"w": torch.full((1000,), s)})
    t = threading.Thread(target=mgr.wait)
    t.start()
    t.join(30)
    mgr.close()
    assert mgr.steps() == [0, 1, 2]


@pytest.mark.parametrize("arenas", [1, 2])
def test_snapshot_second_arena_saves_without_waiting_for_the_previous_write(tmp_path, monkeypatch, arenas):
    from deepnvme.checkpoint import _writer
    real = _writer.Writer._write

    def slow(self, job):
        time.sleep(0.5)
        return real(self, job)

    monkeypatch.setattr(_writer.Writer, "_write", slow)
    w = torch.arange(100_000, dtype=torch.float32)
    with deepnvme.CheckpointManager(tmp_path, staging=deepnvme.SnapshotStager(arenas=arenas), keep=None) as mgr:
        for step in range(3):
            mgr.save(step, {"w": w})
            w.add_(1)  # the snapshot holds the values of each save() call
        waited = mgr.stats.arena_wait_seconds
        mgr.wait()
        got = [mgr.load(step)["w"] for step in range(3)]
    # 1 arena: saves 1 and 2 wait for the writes before them; 2 arenas: only save 2 waits, for save 0
    assert (waited > 0.7) if arenas == 1 else (0.2 < waited < 0.7)
    for step, t in enumerate(got):
        assert torch.equal(t, torch.arange(100_000, dtype=torch.float32) + step)
    with pytest.raises(ValueError, match="arenas"):
        deepnvme.SnapshotStager(arenas=0)


class _SlowState:
    """An object whose ``state_dict()`` takes ``delay`` seconds (a large model's, say)."""

    def __init__(self, delay: float) -> None:
        self.delay, self.value = delay, 0

    def state_dict(self):
        time.sleep(self.delay)
        return {"v": self.value}

    def load_state_dict(self, sd) -> None:
        self.value = sd["v"]


def test_every_seconds_counts_from_the_start_of_the_last_save(tmp_path, monkeypatch):
    from deepnvme.checkpoint import _writer
    real = _writer.Writer._write

    def slow(self, job):
        time.sleep(0.6)
        return real(self, job)

    monkeypatch.setattr(_writer.Writer, "_write", slow)
    with deepnvme.CheckpointManager(tmp_path, every_seconds=0.4, keep=None,
                                     staging=deepnvme.SnapshotStager(arenas=2)) as mgr:
        assert mgr.save(1, {"s": _SlowState(0.5)})  # first: due; its state_dict() takes 0.5 s
        # 0.5 s since save 1 started, though it returned just now: due
        assert mgr.save(2, {"s": _SlowState(0.0)})
        assert not mgr.save(3, {"s": _SlowState(0.0)})  # save 2 started a moment ago
        mgr.wait()  # save 2 commits about 1.2 s after it started
        assert mgr.save(4, {"s": _SlowState(0.0)})  # counted from save 2's start, not its commit
        mgr.wait()
        assert mgr.steps() == [1, 2, 4]
    with deepnvme.CheckpointManager(tmp_path, every_steps=5, every_seconds=0.3) as mgr:
        assert mgr.save(5, {"s": 5})  # by steps, just opened
        assert not mgr.save(6, {"s": 6})  # neither
        time.sleep(0.35)
        assert mgr.save(7, {"s": 7})  # by time


@pytest.mark.parametrize("mode", ["snapshot", "fenced"])
def test_a_full_disk_at_save_names_the_step_and_the_step_can_be_saved_again(tmp_path, monkeypatch, mode):
    from deepnvme.checkpoint import _staging as manager_mod
    real = manager_mod.write_skeleton

    def full(obj, file):  # the disk fills while the training thread writes the skeleton
        real(obj, file)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), file)

    with deepnvme.CheckpointManager(tmp_path, staging=mode, keep=1) as mgr:
        assert mgr.save(1, {"w": torch.ones(1 << 16)})
        mgr.wait()
        monkeypatch.setattr(manager_mod, "write_skeleton", full)
        with pytest.raises(deepnvme.DeepNVMeIOError) as info:
            mgr.save(2, {"w": torch.zeros(1 << 16)})
        assert info.value.errno == errno.ENOSPC and isinstance(info.value.__cause__, OSError)
        assert "step 2 was not saved" in str(info.value) and "earlier checkpoints are intact" in str(info.value)
        assert sorted(os.listdir(tmp_path)) == [".deepnvme-writer.lock", "step-000000000001"]
        assert torch.equal(mgr.load()["w"], torch.ones(1 << 16))
        monkeypatch.setattr(manager_mod, "write_skeleton", real)
        assert mgr.save(2, {"w": torch.zeros(1 << 16)})  # not "not greater than the newest step 2"
    assert mgr.steps() == [2]


def test_a_writer_waits_for_a_manager_that_is_removing_leftovers(tmp_path):
    from deepnvme.checkpoint.manager._lock import try_lock
    tidy = try_lock(str(tmp_path), tidying=True)  # what opening a manager (a reader's too) holds briefly
    with deepnvme.CheckpointManager(tmp_path) as mgr:
        timer = threading.Timer(1.0, tidy.release)
        timer.start()
        start = time.monotonic()
        assert mgr.save(1, {"a": 1})  # waits for the tidying holder instead of failing
        assert time.monotonic() - start >= 0.9
        timer.join()
    assert mgr.steps() == [1]
    with deepnvme.CheckpointManager(tmp_path) as writer:
        writer.save(2, {"a": 2})
        with pytest.raises(deepnvme.CheckpointLockedError):
            try_lock(str(tmp_path), tidying=True)  # tidying never waits for a writer


def test_directory_is_created_and_a_reopened_manager_knows_the_newest_step(tmp_path):
    where = tmp_path / "a" / "b"
    with deepnvme.CheckpointManager(where, keep=None, rng=False) as mgr:
        for step in (5, 6):
            mgr.save(step, {"w": torch.full((10,), float(step)), "n": step})
    assert where.is_dir()
    with deepnvme.CheckpointManager(where, keep=None) as mgr:
        with pytest.raises(ValueError, match="not greater than the newest saved step 6"):
            mgr.save(6, {"w": torch.zeros(10), "n": 0})
        with pytest.raises(ValueError, match="not greater"):
            mgr.save(3, {"w": torch.zeros(10), "n": 0}, force=True)
        state = {"w": torch.zeros(10), "n": None}
        assert mgr.restore(state, step=5) == 5  # a given step, not the newest
        assert torch.equal(state["w"], torch.full((10,), 5.0)) and state["n"] == 5


def test_a_failed_removal_by_retention_is_logged_and_retried_not_a_failed_save(tmp_path, monkeypatch, caplog):
    from deepnvme.checkpoint.manager import _commit
    real, calls = _commit.delete_step, []

    def refuse_once(directory, step):
        calls.append(step)
        if len(calls) == 1:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), directory)
        real(directory, step)

    monkeypatch.setattr(_commit, "delete_step", refuse_once)
    with deepnvme.CheckpointManager(tmp_path, keep=1) as mgr:
        mgr.save(1, {"w": torch.ones(10)})
        with caplog.at_level(logging.ERROR, logger="deepnvme"):
            mgr.save(2, {"w": torch.ones(10)})
            mgr.wait()  # step 2 was committed: nothing to raise
        assert "could not remove step 1" in caplog.text
        assert mgr.steps() == [1, 2]
        mgr.save(3, {"w": torch.ones(10)})
        mgr.wait()
        assert mgr.steps() == [3] and calls == [1, 1, 2]


@dataclasses.dataclass
class _Config:
    lr: float = 0.1


@pytest.mark.parametrize("mode, scan", [("snapshot", True), ("fenced", True), ("snapshot", False)])
def test_plain_data_that_restore_cannot_read_fails_the_save_not_the_restore(tmp_path, monkeypatch, mode, scan):
    np = pytest.importorskip("numpy")
    if not scan:  # a torch without the globals scan: the check unpickles the skeleton instead
        monkeypatch.delattr(torch.serialization, "get_unsafe_globals_in_checkpoint", raising=False)
    w = torch.ones(1 << 17)
    with deepnvme.CheckpointManager(tmp_path, staging=mode, keep=None) as mgr:
        mgr.save(1, {"w": w, "best": 0.5})
        for step, value in ((2, np.float64(0.25)), (3, _Config())):  # torch.load(weights_only) refuses both
            mgr.save(step, {"w": w, "best": value})
            with pytest.raises(deepnvme.CheckpointFormatError,
                               match=f"step {step} was not saved: restore could not.*add_safe_globals"):
                mgr.wait()
        assert mgr.steps() == [1] and not [n for n in os.listdir(tmp_path) if n.startswith(".step-")]
        with torch.serialization.safe_globals([_Config]):  # registered: saved and restored
            mgr.save(4, {"w": w, "best": _Config(0.2)})
            mgr.wait()
            state = {"w": torch.zeros(1 << 17), "best": None}
            assert mgr.restore(state) == 4 and state["best"] == _Config(0.2)


def test_rng_false_neither_saves_nor_restores_generator_states(tmp_path):
    with deepnvme.CheckpointManager(tmp_path, rng=False) as mgr:
        mgr.save(1, {"x": 1})
    assert "_deepnvme_rng" not in mgr.load()
    with deepnvme.CheckpointManager(tmp_path / "with", rng=True) as mgr:
        mgr.save(1, {"x": 1})
    torch.manual_seed(5)
    random.seed(5)
    want = (torch.rand(3), random.random())
    torch.manual_seed(5)
    random.seed(5)
    deepnvme.CheckpointManager(tmp_path / "with", rng=False).restore({"x": 0})  # saved, not restored
    assert torch.equal(torch.rand(3), want[0]) and random.random() == want[1]


def test_a_live_writer_in_another_process_locks_the_directory(tmp_path):
    code = ("import sys, deepnvme; m = deepnvme.CheckpointManager(sys.argv[1]); m.save(1, {'a': 1}); "
            "m.wait(); print('locked', flush=True); sys.stdin.readline(); m.close()")
    proc = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(deepnvme.__file__))})
    try:
        assert proc.stdout.readline().strip() == "locked"
        mgr = deepnvme.CheckpointManager(tmp_path)  # opening and reading need no lock
        assert mgr.steps() == [1] and mgr.load()["a"] == 1
        with pytest.raises(deepnvme.CheckpointLockedError, match=f"pid {proc.pid}"):
            mgr.save(2, {"a": 2})
    finally:
        proc.communicate("\n", timeout=60)
    assert proc.returncode == 0
    assert mgr.save(2, {"a": 2})  # the writer closed: the directory is free
    mgr.close()
    assert mgr.steps() == [1, 2]


def test_config_reaches_the_writes_and_the_reads(tmp_path):
    cfg = {"block_size": 1 << 16, "o_direct": False, "engine": "threads"}
    with deepnvme.CheckpointManager(tmp_path, config=cfg) as mgr:
        mgr.save(1, {"w": torch.arange(1 << 18, dtype=torch.float32)})
        mgr.wait()
        got = mgr._writer._handle.config  # the writer's handle
        assert (got.block_size, got.o_direct, got.engine) == (1 << 16, False, "threads")
    with pytest.raises(deepnvme.ConfigError, match="block_size"):
        deepnvme.CheckpointManager(tmp_path, config={"block_size": -1})
    reader = deepnvme.CheckpointManager(tmp_path, config=cfg)
    assert reader._config.block_size == 1 << 16
    assert torch.equal(reader.load()["w"], torch.arange(1 << 18, dtype=torch.float32))
