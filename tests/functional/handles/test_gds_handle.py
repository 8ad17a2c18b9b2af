"""GdsHandle on CPU: CPU tensors take the aio path; its cuFile path runs against a fake binding
(CPU tensors standing in for device memory), covering chunking, registration and errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import deepnvme
from deepnvme.errors import (
    DeepNVMeIOError,
    FileNotFoundIOError,
    GdsUnavailableError,
    ShortTransferError,
    ValidationError,
)
from deepnvme.handles.gds import GdsHandle, gds_status
from deepnvme.io.posix import Posix

from ...conftest import open_fds, random_tensor, same_bytes
from ...fakes import FakeCuFile, FakeCuFileError, fake_gds_handle_class

FakeGds = fake_gds_handle_class()
SRC = os.path.join(os.path.dirname(__file__), "..", "..", "src")


def test_import_loads_no_binding_and_starts_no_threads():
    code = ("import sys, threading, deepnvme, deepnvme.handles.gds; "
            "h = deepnvme.GdsHandle(); "
            "assert 'cuda.bindings.cufile' not in sys.modules, 'binding imported'; "
            "assert threading.active_count() == 1, threading.enumerate()")
    env = {**os.environ, "PYTHONPATH": os.path.abspath(SRC)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA report")
def test_without_cuda_status_says_why_and_cpu_tensors_still_work(tmp_path):
    status = gds_status()
    assert status.available is False and status.mode is None and "CUDA" in status.detail
    with GdsHandle(block_size=8192) as h:
        with pytest.raises(GdsUnavailableError, match="CUDA device"):
            h.mode
        t = random_tensor(10_000)
        assert h.sync_pwrite(t, str(tmp_path / "f")) == 1
        back = torch.empty_like(t)
        assert h.async_pread(back, str(tmp_path / "f")) == 0 and h.wait() == 1
        assert same_bytes(back, t)
    from deepnvme.compat import GDSBuilder
    assert GDSBuilder().is_compatible() is False


def test_cufile_path_chunks_by_block_size(tmp_path):
    h = FakeGds(block_size=8192, intra_op_parallelism=3)
    t = random_tensor(30_000, torch.uint8)
    path = str(tmp_path / "f")
    assert h.sync_pwrite(t, path, 100) == 1
    calls = h.fake_cufile.calls
    assert sorted((c[3], c[2]) for c in calls) == [(100, 8192), (8292, 8192), (16484, 8192), (24676, 5424)]
    assert all(c[4] == 0 for c in calls) and sorted(c[1] - t.data_ptr() for c in calls) == [0, 8192, 16384, 24576]
    back = torch.empty_like(t)
    assert h.sync_pread(back, path, 100) == 1 and same_bytes(back, t)
    assert h.fake_cufile.handles == {}, "cuFile file handles must be deregistered"
    assert h.mode == "compatibility"
    h.close()


def test_pinned_device_tensors_use_base_and_offset(tmp_path):
    h = FakeGds(block_size=4096)
    example = torch.empty(0, dtype=torch.float32)
    buf = h.new_pinned_device_tensor(10_000, example)
    assert buf.dtype == torch.float32 and buf.numel() == 10_000
    base = buf.data_ptr()
    assert h.fake_cufile.registered == {base: 40_000}
    buf.copy_(random_tensor(10_000))
    part = buf[1000:3000]
    path = str(tmp_path / "f")
    h.sync_pwrite(part, path)
    assert {c[1] for c in h.fake_cufile.calls} == {base}
    assert sorted(c[4] for c in h.fake_cufile.calls) == [4000, 8096]
    back = torch.empty_like(part)
    h.sync_pread(back, path)
    assert same_bytes(back, part)
    assert h.free_pinned_device_tensor(buf) and buf.numel() == 0
    assert h.fake_cufile.registered == {}
    assert not h.free_pinned_device_tensor(buf) and not h.unpin_device_tensor(torch.empty(3))
    other = torch.empty(100)
    assert h.pin_device_tensor(other)
    with pytest.raises(deepnvme.DeepNVMeError, match="cuFileBufRegister"):
        h.pin_device_tensor(other)  # the binding refuses a second registration
    h.close()
    assert h.fake_cufile.registered == {}, "close() deregisters what is still pinned"


def test_cufile_errors_are_exceptions_naming_the_transfer(tmp_path):
    path = str(tmp_path / "f")
    fds = open_fds()
    h = FakeGds(block_size=4096, intra_op_parallelism=1, cufile=FakeCuFile(fail_at=2))
    assert h.async_pwrite(random_tensor(20_000, torch.uint8), path) == 0
    with pytest.raises(DeepNVMeIOError, match="cuFileWrite failed: CU_FILE_IO_ERROR") as info:
        h.wait()
    e = info.value
    assert (e.path, e.offset, e.size, e.errno) == (path, 8192, 4096, 5) and e.__cause__ is not None
    assert len(h.fake_cufile.calls) == 3, "chunks after the failure must be skipped"
    assert h.fake_cufile.handles == {} and open_fds() == fds
    assert h.wait() == 0
    h.close()


def test_short_cufile_transfer_is_an_error(tmp_path):
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"z" * 9000)
    h = FakeGds(block_size=4096, cufile=FakeCuFile(short_at=1))
    with pytest.raises(ShortTransferError) as info:
        h.sync_pread(torch.empty(9000, dtype=torch.uint8), path)
    assert info.value.offset == 4096 and info.value.transferred == 4095
    h.close()


def test_eof_and_missing_file_like_aio(tmp_path):
    path = str(tmp_path / "f")
    h = FakeGds(block_size=4096)
    h.sync_pwrite(random_tensor(5000, torch.uint8), path)
    with pytest.raises(ShortTransferError, match="read past end of file"):
        h.sync_pread(torch.empty(5000, dtype=torch.uint8), path, 1)
    with pytest.raises(FileNotFoundIOError):
        h.sync_pread(torch.empty(5, dtype=torch.uint8), str(tmp_path / "missing"))
    assert h.fake_cufile.handles == {}
    h.close()


def test_validate_and_fsync(tmp_path, monkeypatch):
    path = str(tmp_path / "f")
    h = FakeGds(block_size=4096)
    t = random_tensor(10_000, torch.uint8)
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    assert h.submit_write(t, path, validate=True, fsync=True).result() == 10_000
    assert len(synced) == 1
    bad = FakeGds(block_size=4096)
    bad.fake_cufile.write = lambda fh, base, size, off, boff: size  # claims success, writes nothing
    with pytest.raises(ValidationError):
        bad.pwrite(random_tensor(10_000, torch.uint8, seed=9), str(tmp_path / "g"), True, False)
    h.close(), bad.close()


@pytest.mark.parametrize("returned,error,match", [
    (-5011, DeepNVMeIOError, r"cuFileWrite failed: returned -5011 \(CUfileOpError 5011\)"),
    (-1, DeepNVMeIOError, "cuFileWrite failed: returned -1"),
    (4097, DeepNVMeIOError, "cuFileWrite returned 4097 for 4096 bytes"),
    ("odd", DeepNVMeIOError, "cuFileWrite returned 'odd'"),
    (4000, ShortTransferError, "short write: 4000 of 4096"),
    (0, ShortTransferError, "short write: 0 of 4096"),
    (None, None, None),  # cuda.bindings.cufile: raises on -1, else returns None
])
def test_every_cufile_return_value_is_checked(tmp_path, returned, error, match):
    path = str(tmp_path / "f")
    fds = open_fds()
    h = FakeGds(block_size=4096, intra_op_parallelism=1)
    real = h.fake_cufile.write
    h.fake_cufile.write = lambda fh, base, size, off, boff: (real(fh, base, size, off, boff),
                                                             returned)[1]
    fut = h.submit_write(random_tensor(10_000, torch.uint8), path)
    if error is None:
        assert fut.result() == 10_000
    else:
        with pytest.raises(error, match=match) as info:
            fut.result()
        assert (info.value.path, info.value.offset, info.value.size) == (path, 0, 4096)
        assert len(h.fake_cufile.calls) == 1, "the first error stops the request"
    assert h.fake_cufile.handles == {} and open_fds() == fds
    h.close()


@pytest.mark.parametrize("status,errno_", [(28, 28), (5011, 5), (None, 5)])
def test_binding_exceptions_keep_errno(tmp_path, status, errno_):
    """cuFileError.status is errno after a C return of -1, else a CUfileOpError code."""
    h = FakeGds(block_size=4096)

    def fail(*args):
        exc = FakeCuFileError("fake")
        if status is not None:
            exc.status = status
        raise exc
    h.fake_cufile.read = fail
    path = str(tmp_path / "f")
    h.sync_pwrite(random_tensor(5000, torch.uint8), path)
    with pytest.raises(DeepNVMeIOError, match="cuFileRead failed: fake") as info:
        h.sync_pread(torch.empty(5000, dtype=torch.uint8), path)
    assert info.value.errno == errno_ and isinstance(info.value.__cause__, FakeCuFileError)
    h.close()


def test_cufile_handle_register_and_deregister_failures(tmp_path):
    path = str(tmp_path / "f")
    fds = open_fds()
    h = FakeGds(block_size=4096)

    def refuse(descr_ptr):
        raise FakeCuFileError("CU_FILE_HANDLE_NOT_REGISTERED (fake)")
    h.fake_cufile.handle_register = refuse
    with pytest.raises(DeepNVMeIOError, match="cuFileHandleRegister failed") as info:
        h.sync_pwrite(random_tensor(10_000, torch.uint8), path)
    assert (info.value.path, info.value.offset, info.value.size) == (path, 0, 10_000)
    assert open_fds() == fds and h.fake_cufile.calls == []
    g = FakeGds(block_size=4096)

    def fail_deregister(fh):
        del g.fake_cufile.handles[fh]
        raise FakeCuFileError("deregister (fake)")
    g.fake_cufile.handle_deregister = fail_deregister
    with pytest.raises(DeepNVMeIOError, match="cuFileHandleDeregister failed"):
        g.sync_pwrite(random_tensor(10_000, torch.uint8), path)
    assert open_fds() == fds, "the descriptor closes even when deregistration fails"
    h.close(), g.close()


def test_chunks_wait_for_the_stream_ticket_under_the_device_guard(tmp_path):
    import contextlib

    class RecordingOrder:
        def __init__(self):
            self.log = []

        def begin(self, tensor):
            self.log.append("begin")
            return "ticket"

        def ready(self, ticket):
            self.log.append(("ready", ticket))

        @contextlib.contextmanager
        def guard(self, tensor):
            self.log.append("enter")
            yield
            self.log.append("exit")

    h = FakeGds(block_size=4096, intra_op_parallelism=1)
    h.fake_order = order = RecordingOrder()
    real = h.fake_cufile.write
    h.fake_cufile.write = lambda *a: (order.log.append("io"), real(*a))[1]
    h.sync_pwrite(random_tensor(10_000, torch.uint8), str(tmp_path / "f"))
    chunk = ["enter", ("ready", "ticket"), "io", "exit"]
    assert order.log == ["begin"] + 3 * chunk
    h.close()


class FailingFsync(Posix):
    def __init__(self):
        self.calls = {"open": 0, "close": 0}

    def open(self, path, **kw):
        fd = super().open(path, **kw)
        self.calls["open"] += 1
        return fd

    def close(self, fd):
        self.calls["close"] += 1
        super().close(fd)

    def fsync(self, fd):
        raise OSError(5, "Input/output error")


def test_cufile_requests_use_the_handle_syscall_layer(tmp_path):
    fds = open_fds()
    px = FailingFsync()
    h = FakeGds(block_size=4096, posix=px)
    with pytest.raises(DeepNVMeIOError, match="fsync failed"):
        h.submit_write(random_tensor(10_000, torch.uint8), str(tmp_path / "f"), fsync=True).result()
    assert h.fake_cufile.handles == {} and open_fds() == fds
    assert px.calls["open"] == px.calls["close"] >= 1
    h.close()
    with pytest.raises(RuntimeError, match="closed"):
        h.sync_pwrite(random_tensor(10, torch.uint8), str(tmp_path / "f"))


def test_the_cufile_engine_refuses_submit_many():
    from deepnvme.config import IOConfig
    from deepnvme.io.cufile import BufferRegistry, CuFileMover
    from deepnvme.io.engine import Engine
    engine = Engine(IOConfig(), mover=CuFileMover(FakeCuFile(), BufferRegistry()))
    assert engine.name == "cufile"
    with pytest.raises(ValueError, match="submit_many is not supported by the cufile mover"):
        engine.submit_many(True, "unused", [])
    engine.close()


@pytest.fixture
def fresh_driver(monkeypatch):
    from deepnvme.handles import gds
    monkeypatch.setattr(gds._Driver, "_module", None)
    monkeypatch.setattr(gds._Driver, "_mode", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return gds


@pytest.mark.parametrize("nvfs,forced,mode", [(False, False, "compatibility"), (True, False, "nvidia-fs"),
                                               (True, True, "compatibility")])
def test_status_reports_the_mode(fresh_driver, monkeypatch, nvfs, forced, mode):
    fake = FakeCuFile()
    fake.BoolConfigParameter = type("B", (), {"FORCE_COMPAT_MODE": 7})
    fake.get_parameter_bool = lambda p: forced and p == 7
    monkeypatch.setattr(fresh_driver, "_import_cufile", lambda: fake)
    monkeypatch.setattr(fresh_driver, "nvidia_fs_loaded", lambda: nvfs)
    status = fresh_driver.gds_status()
    assert (status.available, status.mode) == (True, mode) and fake.opened == 1
    fresh_driver.gds_status()
    assert fake.opened == 1, "the driver is opened once per process"


def test_driver_open_failure_is_reported(fresh_driver, monkeypatch):
    fake = FakeCuFile()

    def refuse():
        raise RuntimeError("DRIVER_NOT_INITIALIZED (5001)")
    fake.driver_open = refuse
    monkeypatch.setattr(fresh_driver, "_import_cufile", lambda: fake)
    status = fresh_driver.gds_status()
    assert not status.available and "cuFileDriverOpen failed: DRIVER_NOT_INITIALIZED" in status.detail


def test_missing_binding_names_the_install(fresh_driver):
    import importlib.util
    if importlib.util.find_spec("cuda") is not None:
        pytest.skip("a cuda package is installed here")
    status = fresh_driver.gds_status()
    assert not status.available and "deepnvme[gds]" in status.detail
