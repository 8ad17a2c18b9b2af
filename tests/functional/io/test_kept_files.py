"""Descriptors kept open between requests (``keep_open=True``): one open per file, closed by
close_files/close (after the requests using them), never reaching a deleted or replaced file,
bounded, not reused in a forked child, errors naming the file."""

import errno
import os
import threading
import time

import pytest
import torch

import deepnvme
from deepnvme.errors import DeepNVMeIOError
from deepnvme.io.kept import KeptFiles
from deepnvme.io.posix import Posix
from deepnvme.swap import TensorSwapper

from ...conftest import open_fds

N = 1 << 16


class CountingPosix(Posix):
    """Counts open(2) calls per path; optionally refuses read-write opens (a read-only file)
    or makes reads sleep (requests in flight) or fail with EIO."""

    def __init__(self, *, read_only=False, delay=0.0, fail_reads=False):
        self.opens: dict[str, int] = {}
        self.read_only, self.delay, self.fail_reads = read_only, delay, fail_reads

    def open(self, path, *, write, direct, offset=None, size=None, read_write=False):
        if read_write and self.read_only:
            raise DeepNVMeIOError.from_oserror(OSError(errno.EACCES, "Permission denied"),
                                               op="open", path=path, offset=offset, size=size)
        self.opens[path] = self.opens.get(path, 0) + 1
        return super().open(path, write=write, direct=direct, offset=offset, size=size,
                            read_write=read_write)

    def preadv(self, fd, buffers, offset):
        if self.delay:
            time.sleep(self.delay)
        if self.fail_reads:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().preadv(fd, buffers, offset)


def ramp(seed=0):
    return torch.arange(N // 4, dtype=torch.float32) + seed


def test_kept_file_is_opened_once_and_closed_by_close_files(tmp_path):
    posix = CountingPosix()
    path = str(tmp_path / "f")
    before = open_fds()
    with deepnvme.AioHandle(posix=posix) as h:
        for i in range(5):
            h.submit_write(ramp(i), path, keep_open=True).result()
            out = torch.empty(N // 4)
            h.submit_read(out, path, keep_open=True).result()
            assert torch.equal(out, ramp(i))
        h.read_many(path, [(torch.empty(N // 8), 0), (torch.empty(N // 8), N // 2)],
                    keep_open=True).result()
        assert posix.opens[path] == 1 and open_fds() == before + 1
        h.close_files([path])
        assert open_fds() == before
        h.submit_read(torch.empty(N // 4), path).result()     # without keep_open: its own open
        assert posix.opens[path] == 2
        h.submit_read(torch.empty(N // 4), path, keep_open=True).result()
        assert open_fds() == before + 1
    assert open_fds() == before   # close() closes what is kept


def test_unaligned_requests_keep_one_buffered_descriptor_too(tmp_path):
    posix = CountingPosix()
    path = str(tmp_path / "f")
    with deepnvme.AioHandle(posix=posix) as h:
        data = torch.arange(1000, dtype=torch.uint8)   # 1000 B: a buffered edge each time
        for _ in range(3):
            h.submit_write(data, path, keep_open=True).result()
            out = torch.empty(1000, dtype=torch.uint8)
            h.submit_read(out, path, keep_open=True).result()
            assert torch.equal(out, data)
        assert posix.opens[path] <= 2


def test_a_deleted_or_replaced_file_is_not_reached_through_its_kept_descriptor(tmp_path):
    path = str(tmp_path / "f")
    with deepnvme.AioHandle() as h:
        h.submit_write(ramp(1), path, keep_open=True).result()
        os.unlink(path)
        with pytest.raises(FileNotFoundError) as info:   # not the deleted file's old bytes
            h.submit_read(torch.empty(N // 4), path, keep_open=True).result()
        assert info.value.filename == path or path in str(info.value)
        h.submit_write(ramp(2), path, keep_open=True).result()   # a new file at the path
        other = str(tmp_path / "g")
        with deepnvme.AioHandle() as h2:
            h2.submit_write(ramp(3), other).result()
        os.replace(other, path)                                   # replaced by rename
        out = torch.empty(N // 4)
        h.submit_read(out, path, keep_open=True).result()
        assert torch.equal(out, ramp(3))


def test_read_errors_on_a_kept_file_name_it(tmp_path):
    path = str(tmp_path / "f")
    with deepnvme.AioHandle() as h:
        h.submit_write(ramp(), path).result()
    with deepnvme.AioHandle(posix=CountingPosix(fail_reads=True)) as h:
        with pytest.raises(DeepNVMeIOError) as info:
            h.submit_read(torch.empty(N // 4), path, keep_open=True).result()
        assert info.value.path == path and info.value.errno == errno.EIO
        with pytest.raises(FileNotFoundError, match="missing"):
            h.submit_read(torch.empty(4), str(tmp_path / "missing"), keep_open=True).result()
        assert not os.path.exists(tmp_path / "missing")   # a read never creates the file


def test_a_file_closed_while_in_use_closes_when_its_request_ends(tmp_path):
    path = str(tmp_path / "f")
    with deepnvme.AioHandle() as h:
        h.submit_write(ramp(), path).result()
    before = open_fds()
    with deepnvme.AioHandle(posix=CountingPosix(delay=0.3)) as h:
        fut = h.submit_read(torch.empty(N // 4), path, keep_open=True)
        h.close_files(under=str(tmp_path))
        assert not fut.done() and open_fds() == before + 1   # still used by the read
        fut.result()
        assert open_fds() == before


def test_a_file_that_cannot_be_opened_for_writing_is_kept_for_reads(tmp_path):
    path = str(tmp_path / "f")
    with deepnvme.AioHandle() as h:
        h.submit_write(ramp(4), path).result()
    posix = CountingPosix(read_only=True)
    with deepnvme.AioHandle(posix=posix) as h:
        for _ in range(3):
            out = torch.empty(N // 4)
            h.submit_read(out, path, keep_open=True).result()
            assert torch.equal(out, ramp(4))
        assert posix.opens[path] == 1
        h.submit_write(ramp(5), path, keep_open=True).result()   # opens its own descriptor
        assert posix.opens[path] == 2
        h.submit_read(out, path, keep_open=True).result()
        assert torch.equal(out, ramp(5))


def test_the_table_is_bounded_and_closes_the_least_recently_used_idle_file(tmp_path):
    table = KeptFiles(Posix(), limit=2)

    def opener(path, write, read_write):
        return -1, os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC), None

    before = open_fds()
    paths = [str(tmp_path / n) for n in "abc"]
    held = [table.acquire(p, True, opener) for p in paths[:2]]
    assert table.acquire(paths[2], True, opener) is None     # both in use: no room
    assert open_fds() == before + 2
    held[0].release()
    third = table.acquire(paths[2], True, opener)
    assert third is not None and paths[0] not in table and open_fds() == before + 2
    third.release()
    held[1].release()
    table.close()
    assert open_fds() == before and table.acquire(paths[0], True, opener) is None


def test_a_forked_child_does_not_reuse_the_parents_descriptors(tmp_path):
    table = KeptFiles(Posix())

    def opener(path, write, read_write):
        return -1, os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC), None

    path = str(tmp_path / "f")
    table.acquire(path, True, opener).release()
    pid = os.fork()
    if pid == 0:   # the child: nothing kept is handed out
        os._exit(0 if table.acquire(path, True, opener) is None else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert table.acquire(path, True, opener) is not None   # the parent still reuses it
    table.close()


def test_swapper_keeps_one_descriptor_per_key_and_closes_them(tmp_path):
    before = open_fds()
    h = deepnvme.AioHandle()
    s = TensorSwapper(tmp_path, min_swap_bytes=0, buffer_count=1, buffer_bytes=N, handle=h)
    for i in range(3):
        s.swap_out("a", ramp(i)).result()
        s.swap_out("b", ramp(i)).result()
        assert torch.equal(s.swap_in("a").result(), ramp(i))
        s.release("a")
    assert open_fds() == before + 2
    s.discard("b")
    assert open_fds() == before + 1
    s.close()   # a handle it does not own: its files are closed all the same
    assert open_fds() == before
    h.close()


def test_concurrent_first_uses_of_one_file_keep_one_descriptor(tmp_path):
    path = str(tmp_path / "f")
    with deepnvme.AioHandle(intra_op_parallelism=2) as h:
        h.submit_write(ramp(), path).result()
        before = open_fds()
        outs = [torch.empty(N // 4) for _ in range(8)]
        threads = [threading.Thread(target=lambda o=o: h.submit_read(o, path, keep_open=True)
                                    .result()) for o in outs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(torch.equal(o, ramp()) for o in outs)
        assert open_fds() == before + 1
