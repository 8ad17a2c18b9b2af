"""cuFile byte counts: the binding drops cuFileRead/cuFileWrite's result, so deepnvme calls the C
functions itself (through ctypes) and checks every count. Here the "library" is a pair of Python
functions over :class:`FakeCuFile`, standing in for libcufile's symbols."""

from __future__ import annotations

import errno
import logging

import pytest

from deepnvme.errors import DeepNVMeIOError, ShortTransferError
from deepnvme.io.cufile import counted_binding

from ...conftest import random_tensor, same_bytes
from ...fakes import FakeCuFile, fake_gds_handle_class


class DroppingBinding(FakeCuFile):
    """Like ``cuda.bindings.cufile``: read/write return None, whatever the C call returned."""

    def read(self, *args):
        super().read(*args)

    def write(self, *args):
        super().write(*args)


class FakeLib:
    """libcufile's two symbols over the fake, with ``cut`` bytes missing from the call at ``at``."""

    def __init__(self, binding: FakeCuFile, *, at: int | None = None, cut: int = 1,
                 result: int | None = None) -> None:
        self.binding, self.at, self.cut, self.result, self.n = binding, at, cut, result, 0

        def call(op):
            def fn(fh, base, size, offset, buf_offset):
                done = FakeCuFile._io(binding, op, fh, base, size, offset, buf_offset)
                index, self.n = self.n, self.n + 1
                if index == self.at:
                    return self.result if self.result is not None else done - self.cut
                return done
            return fn
        self.cuFileRead, self.cuFileWrite = call("read"), call("write")


def handle(lib_of):
    binding = DroppingBinding()
    counted = counted_binding(binding, load=lambda: lib_of(binding))
    return fake_gds_handle_class()(block_size=4096, intra_op_parallelism=2, cufile=counted)


def test_counts_pass_through_and_data_round_trips(tmp_path):
    h = handle(lambda b: FakeLib(b))
    t, back = random_tensor(10_000), random_tensor(10_000, seed=1)
    path = str(tmp_path / "x.bin")
    assert h.sync_pwrite(t, path) == 1 and h.sync_pread(back, path) == 1
    assert same_bytes(t, back)
    h.close()


def test_a_short_read_is_an_error_naming_file_and_offset(tmp_path):
    path = str(tmp_path / "x.bin")
    writer = handle(lambda b: FakeLib(b))
    writer.sync_pwrite(random_tensor(3 * 1024), path)
    writer.close()
    h = handle(lambda b: FakeLib(b, at=1, cut=100))   # the second chunk to run comes back short
    with pytest.raises(ShortTransferError) as info:
        h.sync_pread(random_tensor(3 * 1024), path)
    # chunks of 4096 bytes at 0, 4096, 8192 run on two threads: any may be second
    assert info.value.path == path and info.value.offset in (0, 4096, 8192)
    assert info.value.transferred == 3996
    h.close()


def test_a_short_write_is_an_error(tmp_path):
    h = handle(lambda b: FakeLib(b, at=0, cut=1))
    with pytest.raises(ShortTransferError, match="short write"):
        h.sync_pwrite(random_tensor(1000), str(tmp_path / "x.bin"))
    h.close()


def test_a_negative_cufile_error_code_fails_with_its_name(tmp_path):
    h = handle(lambda b: FakeLib(b, at=0, result=-5011))
    with pytest.raises(DeepNVMeIOError, match="CUfileOpError 5011") as info:
        h.sync_pwrite(random_tensor(1000), str(tmp_path / "x.bin"))
    assert info.value.path == str(tmp_path / "x.bin") and info.value.offset == 0
    h.close()


def test_minus_one_fails_with_the_call_errno(tmp_path):
    h = handle(lambda b: FakeLib(b, at=0, result=-1))
    with pytest.raises(DeepNVMeIOError, match="cuFileWrite") as info:
        h.sync_pwrite(random_tensor(1000), str(tmp_path / "x.bin"))
    assert info.value.errno == errno.EIO   # a Python stand-in leaves ctypes' errno at 0
    h.close()


def test_without_the_library_the_binding_is_kept_with_a_warning(caplog):
    binding = DroppingBinding()

    def missing():
        raise OSError("libcufile.so.0: cannot open shared object file")
    with caplog.at_level(logging.WARNING, logger="deepnvme.io.cufile"):
        assert counted_binding(binding, load=missing) is binding
    assert "short cuFileRead/cuFileWrite cannot be detected" in caplog.text


def test_gds_status_registers_a_probe_file(tmp_path, monkeypatch):
    """The driver opening is not enough: the status registers a scratch file in the directory,
    and a binding that refuses it makes GDS unavailable, saying why and where."""
    from deepnvme.handles import gds

    class Refusing(FakeCuFile):
        def handle_register(self, descr_ptr):
            FakeCuFile.Descr.table.pop(descr_ptr)
            raise RuntimeError("HANDLE_NOT_REGISTERED (5027)")

    for binding, available in ((FakeCuFile(), True), (Refusing(), False)):
        monkeypatch.setattr(gds._Driver, "open", classmethod(lambda cls, b=binding: (b, "compatibility")))
        status = gds.gds_status(tmp_path)
        assert status.available is available and status.mode == "compatibility"
        if not available:
            assert "HANDLE_NOT_REGISTERED" in status.detail and str(tmp_path) in status.detail
        assert not list(tmp_path.iterdir())   # the probe file is gone
