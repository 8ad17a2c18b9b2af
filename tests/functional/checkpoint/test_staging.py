"""Stagers, the shared writer and its failure ledger, and the manager's deprecated mode keywords."""

from __future__ import annotations

import errno
import threading
import warnings

import pytest
import torch

import deepnvme
from deepnvme import _deprecation
from deepnvme.checkpoint import Stager, _writer
from deepnvme.checkpoint._staging import Staged


class _Holder:
    """A tensor inside an object that is not a dict, list or tuple."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def test_snapshot_copies_tensors_inside_other_objects_too(tmp_path):
    with deepnvme.AsyncCheckpointer() as ck:
        ck.save({"w": torch.ones(1000)}, tmp_path / "small.pt").wait()  # an arena too small for the next
        inner, outer = torch.arange(300_000, dtype=torch.float32), torch.full((70_000,), 2.0)
        handle = ck.save({"held": _Holder(inner), "w": outer}, tmp_path / "ck.pt")
        inner.zero_()  # changed right after the call: the file holds the values of the call
        outer.zero_()
        handle.wait()
    back = torch.load(tmp_path / "ck.pt", weights_only=False)
    assert torch.equal(back["held"].t, torch.arange(300_000, dtype=torch.float32))
    assert torch.equal(back["w"], torch.full((70_000,), 2.0))


class _Recording(Stager):
    """A custom stager: the snapshot stager's work, with every call recorded."""

    name = "recording"

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self._inner = deepnvme.SnapshotStager()

    def stage(self, obj, file, *, state=None) -> Staged:
        self.calls.append(f"stage on {threading.current_thread().name}")
        staged = self._inner.stage(obj, file, state=state)

        def write(handle, path, hash_fn):
            self.calls.append(f"write on {threading.current_thread().name}")
            return staged.write(handle, path, hash_fn)

        def release():
            self.calls.append("release")
            staged.release()

        return Staged(staged.layout, write, release)

    def close(self) -> None:
        self.calls.append("close")
        self._inner.close()


def test_a_stager_instance_is_called_in_the_documented_order(tmp_path):
    calls: list[str] = []
    w = torch.arange(100_000, dtype=torch.float32)
    with deepnvme.CheckpointManager(tmp_path, staging=_Recording(calls), checksums=True) as mgr:
        assert mgr.mode == "recording"
        mgr.save(1, {"w": w})
        w.add_(1)
        mgr.wait()
        assert torch.equal(mgr.load(1)["w"], torch.arange(100_000, dtype=torch.float32))
    main = threading.current_thread().name
    assert calls == [f"stage on {main}", "write on deepnvme-checkpoint-writer", "release", "close"]


def test_every_failure_is_reported_once_none_is_lost(tmp_path, monkeypatch):
    gate, real = threading.Event(), _writer.reserve

    def full(path, size, **kwargs):
        assert gate.wait(30)
        raise OSError(errno.ENOSPC, "No space left on device (injected)", path)

    monkeypatch.setattr(_writer, "reserve", full)
    with deepnvme.CheckpointManager(tmp_path, staging=deepnvme.SnapshotStager(arenas=2), keep=None) as mgr:
        mgr.save(1, {"w": torch.ones(1000)})
        mgr.save(2, {"w": torch.ones(1000)})  # queued behind the first; both fail
        gate.set()
        for step in (1, 2):
            with pytest.raises(deepnvme.DeepNVMeIOError, match=f"step {step} was not saved"):
                mgr.wait()
        mgr.wait()  # both were reported
        monkeypatch.setattr(_writer, "reserve", real)
        assert mgr.save(1, {"w": torch.ones(1000)})  # a failed step may be saved again
    assert mgr.steps() == [1]


def test_the_deprecated_mode_keywords_map_onto_the_stagers(tmp_path, monkeypatch):
    monkeypatch.setattr(_deprecation, "_warned", set())  # each spelling warns once per process
    with pytest.warns(DeprecationWarning, match=r"staging='fenced'"):
        mgr = deepnvme.CheckpointManager(tmp_path, mode="fenced")
    assert isinstance(mgr.stager, deepnvme.FencedStager) and mgr.mode == "fenced"
    mgr.close()
    with pytest.warns(DeprecationWarning, match=r"FencedStager\(staging_bytes=0, precopy=True\)"):
        mgr = deepnvme.CheckpointManager(tmp_path, mode="fenced", fence_staging_bytes=0, fence_precopy=True)
    assert (mgr.stager.staging_bytes, mgr.stager.precopy) == (0, True)  # type: ignore[attr-defined]
    mgr.close()
    with pytest.warns(DeprecationWarning):  # the other mode's options at their defaults are ignored
        mgr = deepnvme.CheckpointManager(tmp_path, mode="fenced", snapshot_arenas=1, fence_precopy=False)
    assert isinstance(mgr.stager, deepnvme.FencedStager)
    mgr.close()
    with pytest.warns(DeprecationWarning, match=r"SnapshotStager\(arenas=2\)"):
        mgr = deepnvme.CheckpointManager(tmp_path, snapshot_arenas=2)
    assert isinstance(mgr.stager, deepnvme.SnapshotStager) and mgr.stager.arenas == 2
    mgr.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new spelling does not warn
        deepnvme.CheckpointManager(tmp_path, staging=deepnvme.FencedStager(staging_bytes=0)).close()
        deepnvme.CheckpointManager(tmp_path, snapshot_arenas=2).close()  # an old spelling warns once


@pytest.mark.parametrize("kwargs, error, match", [
    ({"mode": "eager"}, ValueError, "mode must be"),
    ({"mode": "fenced", "fence_staging_bytes": -1}, ValueError, "fence_staging_bytes=-1"),
    ({"snapshot_arenas": 0}, ValueError, "snapshot_arenas=0"),
    ({"mode": "snapshot", "fence_precopy": True}, ValueError, "do not apply to mode='snapshot'"),
    ({"mode": "fenced", "snapshot_arenas": 2}, ValueError, "do not apply to mode='fenced'"),
    ({"staging": "fenced", "mode": "fenced"}, ValueError, "staging=... alone"),
    ({"stagng": "fenced"}, TypeError, "unexpected keyword"),
])
def test_bad_staging_arguments_name_the_setting(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        deepnvme.CheckpointManager(tmp_path, **kwargs)
