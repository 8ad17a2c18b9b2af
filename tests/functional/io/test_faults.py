"""Fault injection through a fake syscall layer: every failure surfaces, named, and nothing is lost."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

import deepnvme
from deepnvme.config import IOConfig
from deepnvme.errors import DeepNVMeIOError, ShortTransferError, ValidationError
from deepnvme.io.posix import Posix

from ...conftest import random_tensor, same_bytes


class FaultyPosix(Posix):
    """Real syscalls, with hooks to shorten, interrupt or fail them."""

    def __init__(self, *, max_read=None, max_write=None, eintr_every=0, fail_write_at=None,
                 fail_read_at=None, write_errno=errno.ENOSPC, zero_read=False, zero_write=False,
                 open_direct_errno=None, statx_unsupported=False, fsync_errno=None, corrupt=False):
        self.max_read, self.max_write, self.eintr_every = max_read, max_write, eintr_every
        self.fail_write_at, self.fail_read_at, self.write_errno = fail_write_at, fail_read_at, write_errno
        self.zero_read, self.zero_write = zero_read, zero_write
        self.open_direct_errno, self.statx_unsupported = open_direct_errno, statx_unsupported
        self.fsync_errno, self.corrupt = fsync_errno, corrupt
        self.calls = {"preadv": 0, "pwritev": 0, "eintr": 0, "open": 0, "close": 0}

    def open(self, path, *, write, direct, offset=None, size=None):
        if direct and self.open_direct_errno:
            raise DeepNVMeIOError.from_oserror(OSError(self.open_direct_errno, os.strerror(self.open_direct_errno)),
                                               op="open", path=path, offset=offset, size=size)
        self.calls["open"] += 1
        return super().open(path, write=write, direct=direct, offset=offset, size=size)

    def close(self, fd):
        self.calls["close"] += 1
        super().close(fd)

    def _maybe_eintr(self):
        if self.eintr_every and (self.calls["preadv"] + self.calls["pwritev"]) % self.eintr_every == 1:
            self.calls["eintr"] += 1
            if self.calls["eintr"] % 2:
                raise InterruptedError(errno.EINTR, "Interrupted system call")

    def preadv(self, fd, buffers, offset):
        self.calls["preadv"] += 1
        self._maybe_eintr()
        if self.fail_read_at is not None and offset >= self.fail_read_at:
            raise OSError(errno.EIO, "Input/output error")
        if self.zero_read:
            return 0
        if self.max_read:
            buffers = [buffers[0][: self.max_read]]
        return super().preadv(fd, buffers, offset)

    def pwritev(self, fd, buffers, offset):
        self.calls["pwritev"] += 1
        self._maybe_eintr()
        if self.fail_write_at is not None and offset >= self.fail_write_at:
            raise OSError(self.write_errno, os.strerror(self.write_errno))
        if self.zero_write:
            return 0
        if self.max_write:
            buffers = [buffers[0][: self.max_write]]
        if self.corrupt:
            data = bytearray(buffers[0])
            data[0] ^= 0xFF
            buffers = [memoryview(data)]
        return super().pwritev(fd, buffers, offset)

    def fsync(self, fd):
        if self.fsync_errno:
            raise OSError(self.fsync_errno, os.strerror(self.fsync_errno))
        super().fsync(fd)

    def dio_alignment(self, fd):
        if self.statx_unsupported:
            raise OSError(errno.EINVAL, "no O_DIRECT")
        return super().dio_alignment(fd)


def make(posix, **cfg):
    """A handle on the thread mover, whose syscalls ``posix`` fakes (the kernel engines'
    completions are faked in test_kernel_faults.py)."""
    base = dict(block_size=8192, queue_depth=4, intra_op_parallelism=2, engine="threads")
    base.update(cfg)
    return deepnvme.AioHandle(config=IOConfig(**base), posix=posix)


def test_short_transfers_are_completed(tmp_path):
    px = FaultyPosix(max_read=1000, max_write=700)
    with make(px, o_direct=False) as h:
        t = random_tensor(100_003, torch.uint8)
        h.sync_pwrite(t, str(tmp_path / "f"))
        back = torch.empty_like(t)
        h.sync_pread(back, str(tmp_path / "f"))
    assert same_bytes(back, t)
    assert px.calls["pwritev"] > 100_003 // 700 and px.calls["preadv"] > 100_003 // 1000


def test_eintr_is_retried(tmp_path):
    px = FaultyPosix(eintr_every=3)
    with make(px) as h:
        t = random_tensor(200_000, torch.uint8)
        h.sync_pwrite(t, str(tmp_path / "f"))
        back = torch.empty_like(t)
        h.sync_pread(back, str(tmp_path / "f"))
    assert same_bytes(back, t) and px.calls["eintr"] > 2


def assert_enospc_surfaces(h, path: str, t: torch.Tensor, *, said: str) -> None:
    """A write past 64 KiB fails with ENOSPC: sync raises it naming the file, offset and size
    (and ``said``), async raises it at wait(), and the handle stays usable."""
    with pytest.raises(DeepNVMeIOError) as info:
        h.sync_pwrite(t, path)
    e = info.value
    assert e.errno == errno.ENOSPC and isinstance(e, OSError)
    assert e.path == path and e.offset >= 65536 and e.size > 0
    assert path in str(e) and f"offset {e.offset}" in str(e) and said in str(e)
    assert h.async_pwrite(t, path) == 0  # async: returns, error at wait()
    with pytest.raises(DeepNVMeIOError) as again:
        h.wait()
    assert again.value.errno == errno.ENOSPC
    assert h.wait() == 0  # the handle stays usable


def test_enospc_names_file_offset_size_and_surfaces_at_wait(tmp_path):
    px = FaultyPosix(fail_write_at=65536)
    path = str(tmp_path / "f")
    with make(px) as h:
        t = random_tensor(200_000, torch.uint8)
        assert_enospc_surfaces(h, path, t, said="No space left")
        px.fail_write_at = None
        assert h.sync_pwrite(t, path) == 1


def test_first_error_wins_and_siblings_are_skipped(tmp_path):
    px = FaultyPosix(fail_write_at=0)
    with make(px, intra_op_parallelism=1, queue_depth=2, block_size=4096) as h:
        with pytest.raises(DeepNVMeIOError):
            h.sync_pwrite(random_tensor(4096 * 64, torch.uint8), str(tmp_path / "f"))
    assert px.calls["pwritev"] < 8  # 64 chunks planned, almost all skipped after the failure


def test_eof_mid_read_is_an_error(tmp_path):
    path = str(tmp_path / "f")
    with make(Posix()) as h:
        h.sync_pwrite(random_tensor(50_000, torch.uint8), path)
    with make(FaultyPosix(zero_read=True)) as h:
        with pytest.raises(ShortTransferError, match="unexpected end of file") as info:
            h.sync_pread(torch.empty(50_000, dtype=torch.uint8), path)
        assert info.value.path == path and "0 of" in str(info.value)


def test_read_past_eof_is_refused_up_front(tmp_path, handle):
    path = str(tmp_path / "f")
    handle.sync_pwrite(random_tensor(1000, torch.uint8), path)
    with pytest.raises(ShortTransferError, match="file has 1000 bytes but the request ends at 1001"):
        handle.sync_pread(torch.empty(1001, dtype=torch.uint8), path)
    with pytest.raises(ShortTransferError):
        handle.sync_pread(torch.empty(1, dtype=torch.uint8), path, 1000)


def test_write_making_no_progress_is_an_error(tmp_path):
    with make(FaultyPosix(zero_write=True)) as h:
        with pytest.raises(ShortTransferError, match="no progress"):
            h.sync_pwrite(random_tensor(10_000, torch.uint8), str(tmp_path / "f"))


def test_eio_on_read(tmp_path, handle):
    path = str(tmp_path / "f")
    handle.sync_pwrite(random_tensor(100_000, torch.uint8), path)
    with make(FaultyPosix(fail_read_at=40_000)) as h:
        with pytest.raises(DeepNVMeIOError) as info:
            h.sync_pread(torch.empty(100_000, dtype=torch.uint8), path)
    assert info.value.errno == errno.EIO


@pytest.mark.parametrize("fault,subdir,logged", [
    ({"open_direct_errno": errno.EINVAL}, "nodirect", "buffered I/O instead of O_DIRECT"),
    ({"statx_unsupported": True}, "nostatx", "statx"),
], ids=["o_direct_refused_at_open", "statx_says_no_direct"])
def test_no_o_direct_falls_back_to_buffered_and_logs(tmp_path, caplog, fault, subdir, logged):
    sub = tmp_path / subdir  # a directory of its own: the fallback is logged once per directory
    sub.mkdir()
    with caplog.at_level(logging.WARNING, logger="deepnvme"):
        with make(FaultyPosix(**fault)) as h:
            t = random_tensor(30_001, torch.uint8)
            h.sync_pwrite(t, str(sub / "f"))
            back = torch.empty_like(t)
            h.sync_pread(back, str(sub / "f"))
    assert same_bytes(back, t)
    assert any(logged in r.message for r in caplog.records)


def test_other_open_errors_are_not_swallowed(tmp_path):
    with make(FaultyPosix(open_direct_errno=errno.EACCES)) as h:
        with pytest.raises(DeepNVMeIOError, match="Permission denied") as info:
            h.sync_pwrite(random_tensor(10, torch.uint8), str(tmp_path / "f"))
    assert info.value.errno == errno.EACCES and isinstance(info.value, PermissionError)


def test_errors_pickle_with_their_details(tmp_path, handle):
    import pickle
    with pytest.raises(DeepNVMeIOError) as info:
        handle.sync_pread(torch.empty(10), str(tmp_path / "gone"))
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is type(info.value) and again.errno == errno.ENOENT
    assert (again.path, again.offset, again.size) == (info.value.path, 0, 40)
    assert str(again) == str(info.value)
    short = ShortTransferError("eof", path="p", offset=1, size=2, transferred=1)
    assert pickle.loads(pickle.dumps(short)).transferred == 1


def test_missing_file_and_directory(tmp_path, handle):
    with pytest.raises(DeepNVMeIOError) as info:
        handle.sync_pread(torch.empty(10), str(tmp_path / "nope"))
    assert info.value.errno == errno.ENOENT and "nope" in str(info.value)
    assert isinstance(info.value, FileNotFoundError)  # the usual except clauses still work
    assert handle.async_pwrite(torch.empty(10), str(tmp_path / "no" / "dir")) == 0
    with pytest.raises(DeepNVMeIOError, match="No such file"):
        handle.wait()


def test_fsync_failure_surfaces(tmp_path):
    with make(FaultyPosix(fsync_errno=errno.EIO)) as h:
        with pytest.raises(DeepNVMeIOError, match="fsync failed"):
            h.submit_write(random_tensor(10_000, torch.uint8), str(tmp_path / "f"), fsync=True).result()


def test_validate_detects_corruption(tmp_path):
    with make(FaultyPosix(corrupt=True), o_direct=False) as h:
        with pytest.raises(ValidationError, match="validation failed"):
            h.pwrite(random_tensor(20_000, torch.uint8), str(tmp_path / "f"), True, False)


class ClaimsWrites(Posix):
    """Writes report success and store nothing (a lying device)."""

    def pwritev(self, fd, buffers, offset):
        return sum(len(b) for b in buffers)


def test_validate_reports_a_file_shorter_than_the_buffer(tmp_path):
    with make(ClaimsWrites(), o_direct=False) as h:
        with pytest.raises(ValidationError, match="the file ends before the buffer") as info:
            h.pwrite(random_tensor(20_000, torch.uint8), str(tmp_path / "f"), True, False)
    assert isinstance(info.value.__cause__, ShortTransferError)


def test_every_opened_fd_is_closed_after_failures(tmp_path):
    px = FaultyPosix(fail_write_at=4096)
    with make(px) as h:
        for _ in range(20):
            with pytest.raises(DeepNVMeIOError):
                h.sync_pwrite(random_tensor(50_000, torch.uint8), str(tmp_path / "f"))
    assert px.calls["open"] == px.calls["close"] > 0


def test_direct_read_cut_short_by_a_truncation_names_eof(tmp_path, handle):
    """A file that shrinks after the size check: the direct read stops at EOF -> ShortTransferError."""
    path = str(tmp_path / "f")
    handle.sync_pwrite(random_tensor(64 * 1024, torch.uint8), path)

    class Shrinking(FaultyPosix):
        sizes = 0

        def file_size(self, fd):
            self.sizes += 1
            return 64 * 1024 if self.sizes == 1 else 4096

    px = Shrinking(max_read=4096)
    with make(px, intra_op_parallelism=1, block_size=64 * 1024) as h:
        with pytest.raises(ShortTransferError, match="4096 of 65536 bytes"):
            h.sync_pread(deepnvme.new_cpu_locked_tensor(64 * 1024), path)  # aligned: DIRECT


def test_aligned_transfers_really_use_o_direct(tmp_path):
    """Guards the direct path itself: on a filesystem that takes O_DIRECT, the aligned middle
    of a request must go through an O_DIRECT descriptor (and the edges must not)."""

    class Recording(FaultyPosix):
        def __init__(self):
            super().__init__()
            self.kinds = []

        def pwritev(self, fd, buffers, offset):
            self.kinds.append((self.is_direct(fd), offset, len(buffers[0])))
            return super().pwritev(fd, buffers, offset)

    px = Recording()
    probe = Posix()
    fd = probe.open(str(tmp_path / "probe"), write=True, direct=True)
    try:
        if probe.dio_alignment(fd) is None:
            pytest.skip("kernel does not report O_DIRECT alignment here")
    finally:
        probe.close(fd)
    with make(px, block_size=65536) as h:
        t = deepnvme.new_cpu_locked_tensor(300_000)
        h.sync_pwrite(t, str(tmp_path / "f"), 100)
    direct = [k for k in px.kinds if k[0]]
    buffered = [k for k in px.kinds if not k[0]]
    assert direct and sum(n for _, _, n in direct) >= 290_000
    assert buffered and all(n < 4096 * 2 for _, _, n in buffered)
