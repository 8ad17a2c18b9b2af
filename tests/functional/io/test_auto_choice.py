"""engine="auto" with io_uring and Linux AIO both available: each transfer goes to the mover
its class names (deepnvme.io.choice), for real: counted at the kernel queues, the bytes
checked, and a fault on either mover still surfaces named."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import deepnvme
from deepnvme.config import IOConfig
from deepnvme.errors import DeepNVMeIOError
from deepnvme.io import engine as engine_module
from deepnvme.io import movers, uring
from deepnvme.io.posix import Posix
from deepnvme.memory import pinned
from deepnvme.memory.views import aligned_empty

from ...conftest import AVAILABLE_ENGINES, open_fds, random_tensor, same_bytes
from ...fake_queues import install_faulty_queue

ENGINE_SPECIFIC = True  # the real auto, never forced to one engine
pytestmark = pytest.mark.skipif(not {"io_uring", "aio"} <= set(AVAILABLE_ENGINES),
                                reason="needs both io_uring and Linux AIO")
BIG = 1 << 20


@pytest.fixture
def counted(monkeypatch):
    """The kernel queues of new handles, per engine, each counting what it was given."""
    return {e: install_faulty_queue(monkeypatch, e) for e in ("io_uring", "aio")}


def preps(counted):
    return {e: sum(q.calls["prep"] for q in qs) for e, qs in counted.items()}


def make(**cfg):
    base = dict(block_size=256 << 10, queue_depth=8, intra_op_parallelism=1, engine="auto")
    base.update(cfg)
    return deepnvme.AioHandle(config=IOConfig(**base))


def went(counted, before, mover):
    """The transfers since ``before`` reached ``mover``'s queues only."""
    after = preps(counted)
    moved = {e: after[e] - before[e] for e in after}
    other = "aio" if mover == "io_uring" else "io_uring"
    assert moved[mover] > 0 and moved[other] == 0, moved
    return after


@pytest.fixture
def no_fallocate(monkeypatch):
    """A filesystem that cannot allocate ahead: writes past the end stay file-extending."""
    monkeypatch.setattr(Posix, "extend", lambda self, fd, offset, length: errno.EOPNOTSUPP)


def test_each_class_goes_to_its_mover(tmp_path, counted, no_fallocate):
    path = str(tmp_path / "f")
    src = random_tensor(BIG, torch.uint8)
    small = [(random_tensor(4096, torch.uint8, seed=i), i * 4096) for i in range(64)]
    with make() as h:
        assert h.engine == "io_uring" and h._engine.movers == ("io_uring", "aio")
        n = preps(counted)
        h.submit_write(src, path).result()                     # new file: extends it
        n = went(counted, n, "io_uring")
        h.submit_write(src, path).result()                     # over the same bytes
        n = went(counted, n, "aio")
        back = aligned_empty(BIG)
        h.submit_read(back, path).result()
        n = went(counted, n, "aio")
        assert same_bytes(back, src)
        h.write_many(path, small).result()                     # small items, inside the file
        n = went(counted, n, "aio")
        got = [(aligned_empty(4096), off) for _, off in small]
        h.read_many(path, got).result()
        n = went(counted, n, "io_uring")
        assert all(same_bytes(g, s) for (g, _), (s, _) in zip(got, small))
        h.write_many(path, [(t, BIG + off) for t, off in small]).result()  # extends the file
        n = went(counted, n, "io_uring")
        h.submit_write(src[:5000], path, offset=100).result()  # unaligned edges: buffered
        went(counted, n, "io_uring")
        choices = {k: c.mover for k, c in h._engine.choices().items()}
    assert choices == {"file-extending write, 1 worker": "io_uring", "large direct overwrite": "aio",
                       "large direct read": "aio", "small direct writes": "aio",
                       "small direct reads": "io_uring", "buffered": "io_uring"}
    with open(path, "rb") as f:
        whole = f.read()
    assert len(whole) == BIG + 64 * 4096
    assert whole[100:5100] == src[:5000].numpy().tobytes()


@pytest.mark.parametrize("size", [BIG, 3 * BIG + 5000])
def test_a_write_past_the_end_grows_the_file_first_and_queues_as_an_overwrite(tmp_path, counted, size):
    """The file is grown to the write's end before it starts (fallocate), so Linux AIO queues
    it instead of running it synchronously; the size comes out exact, an unaligned tail too
    (written through the buffered descriptor inside the grown size)."""
    path = str(tmp_path / "f")
    probe = os.open(str(tmp_path / "probe"), os.O_CREAT | os.O_WRONLY)
    try:
        if Posix().extend(probe, 0, 4096):
            pytest.skip("this filesystem cannot allocate ahead (fallocate)")
    finally:
        os.close(probe)
    src = random_tensor(size, torch.uint8)
    with make() as h:
        n = preps(counted)
        h.submit_write(src, path).result()
        if size % 4096 == 0:   # a request with an unaligned tail is classed buffered as a whole
            went(counted, n, "aio")
            assert set(h._engine.choices()) == {"large direct overwrite"}
    assert os.path.getsize(path) == size
    with open(path, "rb") as f:
        assert f.read() == src.numpy().tobytes()


def test_only_the_range_written_past_the_end_is_allocated(tmp_path):
    """A write far past the end leaves the hole before it a hole (no gigabytes allocated)."""
    path = str(tmp_path / "f")
    src = random_tensor(BIG, torch.uint8)
    far = 256 * BIG
    with make() as h:
        h.submit_write(src, path, offset=far).result()
    st = os.stat(path)
    assert st.st_size == far + BIG
    assert st.st_blocks * 512 < 8 * BIG, st.st_blocks
    with open(path, "rb") as f:
        f.seek(far)
        assert f.read() == src.numpy().tobytes()


def test_with_several_workers_file_extending_writes_go_to_aio(tmp_path, counted, no_fallocate):
    path = str(tmp_path / "f")
    src = random_tensor(BIG, torch.uint8)
    with make(intra_op_parallelism=2) as h:
        n = preps(counted)
        h.submit_write(src, path).result()
        n = went(counted, n, "aio")
        h.submit_write(src[:5000], path, offset=BIG + 100).result()  # buffered edges: io_uring
        went(counted, n, "io_uring")
        choices = {k: c.mover for k, c in h._engine.choices().items()}
    assert choices == {"file-extending write, 2+ workers": "aio", "buffered": "io_uring"}
    with open(path, "rb") as f:
        assert f.read(BIG) == src.numpy().tobytes()


def test_no_o_direct_goes_to_io_uring(tmp_path, counted):
    path = str(tmp_path / "f")
    src = random_tensor(BIG, torch.uint8)
    with make(o_direct=False) as h:
        h.submit_write(src, path).result()
        h.submit_write(src, path).result()
        back = torch.empty_like(src)
        h.submit_read(back, path).result()
        assert {c.mover for c in h._engine.choices().values()} == {"io_uring"}
    assert same_bytes(back, src) and preps(counted)["aio"] == 0


def test_a_named_engine_uses_it_for_everything(tmp_path, counted):
    path = str(tmp_path / "f")
    src = random_tensor(BIG, torch.uint8)
    with make(engine="aio") as h:
        assert h._engine.movers == ("aio",)
        h.submit_write(src, path).result()
        h.submit_write(src, path).result()
    assert preps(counted)["io_uring"] == 0 and preps(counted)["aio"] > 0


@pytest.mark.parametrize("mover", ["io_uring", "aio"])
def test_a_failure_on_either_mover_is_named(tmp_path, monkeypatch, no_fallocate, mover):
    path = str(tmp_path / "f")
    src = random_tensor(BIG, torch.uint8)
    with open(path, "wb") as f:  # the file exists: the overwrite goes to aio
        f.write(bytes(BIG))
    install_faulty_queue(monkeypatch, mover, fail_write_at=0, errno_=errno.EIO)
    target = path if mover == "aio" else str(tmp_path / "new")
    with make() as h:
        with pytest.raises(DeepNVMeIOError, match=r"EIO|Input/output") as info:
            h.submit_write(src, target).result()
    assert info.value.path == target and info.value.errno == errno.EIO


def test_close_with_work_on_both_movers_loses_nothing(tmp_path):  # one worker: both movers
    before = open_fds(rings=True)
    srcs = [random_tensor(BIG, torch.uint8, seed=i) for i in range(6)]
    paths = [str(tmp_path / f"f{i}") for i in range(6)]
    h = make()
    futs = [h.submit_write(s, p) for s, p in zip(srcs, paths)]          # io_uring (new)
    for f in futs:
        f.result()
    futs = [h.submit_write(s.flip(0).contiguous(), p) for s, p in zip(srcs, paths)]  # aio
    futs += [h.submit_write(s, p + "-b") for s, p in zip(srcs, paths)]  # io_uring
    h.close()
    assert all(f.done() and f.exception() is None for f in futs)
    for s, p in zip(srcs, paths):
        with open(p, "rb") as f:
            assert f.read() == s.flip(0).numpy().tobytes()
        assert os.path.getsize(p + "-b") == BIG
    assert open_fds(rings=True) == before


needs_registration = pytest.mark.skipif(not movers.registers_buffers(),
                                        reason="io_uring here cannot register buffers")


@needs_registration
def test_a_reused_locked_buffer_goes_to_io_uring_from_its_second_transfer(tmp_path, counted):
    """A page-locked buffer's first large transfer stays with Linux AIO (registering would pin
    all of it for one use); from its second, io_uring, which registers it once. Another
    buffer starts over; a plain tensor never switches."""
    path = str(tmp_path / "f")
    buf = deepnvme.new_cpu_locked_tensor(BIG, torch.uint8)
    buf.copy_(random_tensor(BIG, torch.uint8))
    with make() as h:
        n = preps(counted)
        h.submit_write(buf, path).result()                     # first use: grown, overwrite
        n = went(counted, n, "aio")
        h.submit_write(buf, path).result()                     # second use: registered
        n = went(counted, n, "io_uring")
        back = deepnvme.new_cpu_locked_tensor(BIG, torch.uint8)
        h.submit_read(back, path).result()                     # a new buffer: first use
        n = went(counted, n, "aio")
        back.zero_()
        h.submit_read(back, path).result()
        n = went(counted, n, "io_uring")
        assert same_bytes(back, buf)
        plain = aligned_empty(BIG)
        for _ in range(2):
            h.submit_read(plain, path).result()
            n = went(counted, n, "aio")
        assert same_bytes(plain, buf)
        choices = {k: c.mover for k, c in h._engine.choices().items()}
        for t in (buf, back):  # registered with the ring
            assert uring._holders.get(pinned.locked_region(t.data_ptr(), BIG)[0])
    assert choices == {"large direct overwrite": "aio", "large direct read": "aio",
                       "large direct overwrite, reused locked buffer": "io_uring",
                       "large direct read, reused locked buffer": "io_uring"}


@needs_registration
def test_a_buffer_io_uring_could_not_register_stays_with_aio(tmp_path, counted, monkeypatch):
    """A registration refused (a memlock limit) sends that buffer back to Linux AIO: without
    registration io_uring pins pages per request at more CPU than Linux AIO."""
    def refuse(self, slot, base, size):
        raise OSError(errno.ENOMEM, "memlock limit")

    monkeypatch.setattr(uring.UringQueue, "_set_slot", refuse)
    path = str(tmp_path / "f")
    buf = deepnvme.new_cpu_locked_tensor(BIG, torch.uint8)
    buf.copy_(random_tensor(BIG, torch.uint8))
    with make() as h:
        h.submit_write(buf, path).result()
        n = preps(counted)
        h.submit_write(buf, path).result()                     # io_uring tries, is refused
        n = went(counted, n, "io_uring")
        h.submit_write(buf, path).result()
        went(counted, n, "aio")
    region, uses = pinned.count_transfer(buf.data_ptr(), BIG)
    assert region in uring.REFUSED and uses == 3
    with open(path, "rb") as f:
        assert f.read() == buf.numpy().tobytes()


def test_without_buffer_registration_reused_buffers_stay_with_aio(tmp_path, counted, monkeypatch):
    monkeypatch.setattr(engine_module, "registers_buffers", lambda: False)
    path = str(tmp_path / "f")
    buf = deepnvme.new_cpu_locked_tensor(BIG, torch.uint8)
    with make() as h:
        n = preps(counted)
        for _ in range(3):
            h.submit_write(buf, path).result()
        went(counted, n, "aio")
