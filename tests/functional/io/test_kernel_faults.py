"""Fault injection into the kernel engines' completions (io_uring, Linux AIO): every short,
interrupted or failed completion is retried or surfaces, named, and nothing leaks."""

from __future__ import annotations

import errno
import logging
import os

import pytest
import torch

import deepnvme
from deepnvme.config import IOConfig
from deepnvme.errors import ConfigError, DeepNVMeIOError, ShortTransferError
from deepnvme.io import movers

from ...conftest import AVAILABLE_ENGINES, open_fds, random_tensor, same_bytes
from ...fake_queues import install_faulty_queue
from ._kernel_handles import KERNEL_ENGINES
from .test_faults import assert_enospc_surfaces

ENGINE_SPECIFIC = True  # not re-run per engine by conftest: each test names its engine
pytestmark = pytest.mark.skipif(not KERNEL_ENGINES, reason="no kernel engine on this system")


def make(engine, **cfg):
    base = dict(block_size=8192, queue_depth=4, intra_op_parallelism=2, engine=engine)
    base.update(cfg)
    return deepnvme.AioHandle(config=IOConfig(**base))


@pytest.mark.parametrize("o_direct", [True, False])
def test_short_completions_are_resubmitted(tmp_path, monkeypatch, kernel, o_direct):
    queues = install_faulty_queue(monkeypatch, kernel, max_len=4096 if o_direct else 700)
    with make(kernel, o_direct=o_direct) as h:
        t = random_tensor(100_003, torch.uint8)
        h.sync_pwrite(t, str(tmp_path / "f"))
        back = torch.empty_like(t)
        h.sync_pread(back, str(tmp_path / "f"))
    assert same_bytes(back, t)
    assert sum(q.calls["short"] for q in queues) > 10


def test_eintr_and_eagain_are_retried(tmp_path, monkeypatch, kernel):
    queues = install_faulty_queue(monkeypatch, kernel, eintr_every=3, eagain_every=5)
    with make(kernel) as h:
        t = random_tensor(200_000, torch.uint8)
        h.sync_pwrite(t, str(tmp_path / "f"))
        back = torch.empty_like(t)
        h.sync_pread(back, str(tmp_path / "f"))
    assert same_bytes(back, t)
    assert sum(q.calls["eintr"] for q in queues) > 2 and sum(q.calls["eagain"] for q in queues) > 2


def test_enospc_names_file_offset_errno_and_surfaces_at_wait(tmp_path, monkeypatch, kernel):
    install_faulty_queue(monkeypatch, kernel, fail_write_at=65536)
    with make(kernel) as h:
        assert_enospc_surfaces(h, str(tmp_path / "f"), random_tensor(200_000, torch.uint8),
                               said=kernel)


def test_eio_on_read(tmp_path, monkeypatch, kernel):
    path = str(tmp_path / "f")
    with make(kernel) as h:
        h.sync_pwrite(random_tensor(100_000, torch.uint8), path)
    install_faulty_queue(monkeypatch, kernel, fail_read_at=40_000, errno_=errno.EIO)
    with make(kernel) as h:
        with pytest.raises(DeepNVMeIOError) as info:
            h.sync_pread(torch.empty(100_000, dtype=torch.uint8), path)
    assert info.value.errno == errno.EIO and info.value.offset >= 40_000 - 8192


def test_first_error_wins_and_siblings_are_skipped(tmp_path, monkeypatch, kernel):
    queues = install_faulty_queue(monkeypatch, kernel, fail_write_at=0)
    with make(kernel, intra_op_parallelism=1, queue_depth=2, block_size=4096) as h:
        with pytest.raises(DeepNVMeIOError):
            h.sync_pwrite(random_tensor(4096 * 64, torch.uint8), str(tmp_path / "f"))
    assert sum(q.calls["prep"] for q in queues) < 8  # 64 chunks planned, the rest skipped


def test_zero_byte_completions_are_errors(tmp_path, monkeypatch, kernel):
    path = str(tmp_path / "f")
    with make(kernel) as h:
        h.sync_pwrite(random_tensor(50_000, torch.uint8), path)
    install_faulty_queue(monkeypatch, kernel, zero_read=True, zero_write=True)
    with make(kernel) as h:
        with pytest.raises(ShortTransferError, match="unexpected end of file"):
            h.sync_pread(torch.empty(50_000, dtype=torch.uint8), path)
        with pytest.raises(ShortTransferError, match="no progress"):
            h.sync_pwrite(random_tensor(10_000, torch.uint8), path)


def test_direct_read_stopping_at_eof_is_named(tmp_path, monkeypatch, kernel):
    """The file shrinks after the size check: the direct read ends at EOF, which must be
    reported as such, not retried into EINVAL."""
    path = str(tmp_path / "f")
    with make(kernel) as h:
        h.sync_pwrite(random_tensor(64 * 1024, torch.uint8), path)
    from deepnvme.io.posix import Posix

    class Shrinking(Posix):
        sizes = 0

        def file_size(self, fd):
            size = super().file_size(fd)
            self.sizes += 1
            if self.sizes == 1:  # right after the up-front check: really shrink the file
                os.truncate(path, 4096)
            return size

    h = deepnvme.AioHandle(config=IOConfig(block_size=64 * 1024, intra_op_parallelism=1,
                                           engine=kernel), posix=Shrinking())
    with h, pytest.raises(ShortTransferError, match="unexpected end of file"):
        h.sync_pread(deepnvme.new_cpu_locked_tensor(64 * 1024), path)


def test_no_fd_or_ring_leaks_over_thousands_of_ops(tmp_path, kernel):
    path = str(tmp_path / "f")
    files, rings = open_fds(), open_fds(rings=True)
    t = random_tensor(12_345, torch.uint8)
    back = torch.empty_like(t)
    for round_ in range(3):
        with make(kernel, intra_op_parallelism=2, queue_depth=8) as h:
            for i in range(400):
                h.async_pwrite(t, path, (i % 7) * 5000)
                if i % 50 == 49:
                    h.wait()
            h.wait()
            for i in range(400):
                h.async_pread(back, path, 0)
            h.wait()
            with pytest.raises(DeepNVMeIOError):
                h.sync_pread(back, str(tmp_path / "missing"))
    assert open_fds() == files and open_fds(rings=True) == rings


def test_close_with_work_in_flight_loses_nothing(tmp_path, kernel):
    h = make(kernel, block_size=4096, queue_depth=16, intra_op_parallelism=2)
    tensors = [random_tensor(50_000 + i, torch.uint8, seed=i) for i in range(40)]
    futures = [h.submit_write(t, str(tmp_path / f"f{i}")) for i, t in enumerate(tensors)]
    h.close()  # no wait(): close must finish them, not drop or hang
    assert all(f.done() and f.result() == t.nbytes for f, t in zip(futures, tensors))
    with make("threads") as r:
        for i, t in enumerate(tensors):
            back = torch.empty_like(t)
            r.sync_pread(back, str(tmp_path / f"f{i}"))
            assert same_bytes(back, t)


def test_engine_named_but_unavailable_raises(monkeypatch):
    def refuse() -> str:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setitem(movers._PROBES, "io_uring", refuse)
    movers._probe.cache_clear()
    try:
        with pytest.raises(ConfigError, match="io_uring.*not available.*Operation not permitted"):
            deepnvme.AioHandle(engine="io_uring")
        with pytest.raises(ConfigError, match="unknown engine 'uring'"):
            deepnvme.AioHandle(engine="uring")
    finally:
        movers._probe.cache_clear()


def test_auto_falls_back_and_says_why(monkeypatch, caplog):
    def refuse() -> str:
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setitem(movers._PROBES, "io_uring", refuse)
    monkeypatch.setattr(movers, "_fallback_logged", set())
    movers._probe.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="deepnvme"):
            with deepnvme.AioHandle(engine="auto") as h:
                expected = "aio" if "aio" in AVAILABLE_ENGINES else "threads"
                assert h.engine == expected
            with deepnvme.AioHandle() as h2:
                assert h2.engine == expected
        lines = [r.message for r in caplog.records if "engine auto uses" in r.message]
        assert len(lines) == 1 and "io_uring unavailable" in lines[0]
        assert "kernel.io_uring_disabled" in lines[0]
    finally:
        movers._probe.cache_clear()
