"""DeepSpeed client calls as DeepSpeed's pybind signatures allow them: keyword names (``buffer``,
``filename``, ``validate``, ``file_offset``, ``async``, ``fd``, ``example_tenosr``), and
``PinMemoryBuilder`` sharing locked memory with the handles. Every form is a real round trip."""

from __future__ import annotations

import errno
import os

import pytest
import torch

import deepnvme
from deepnvme import compat
from deepnvme.handles.gds import GdsHandle
from deepnvme.memory.pinned import locked_bytes

from ...conftest import random_tensor, same_bytes
from ...fakes import fake_gds_handle_class

HANDLES = {
    "aio": lambda: compat.AsyncIOBuilder().load().aio_handle(8192, 8, False, False, 2),
    "gds-cpu": lambda: GdsHandle(block_size=8192, intra_op_parallelism=2),
    "gds-fake-cufile": lambda: fake_gds_handle_class()(block_size=8192, intra_op_parallelism=2),
}
OFFSET = 3 * 4096 + 512


@pytest.fixture(params=sorted(HANDLES))
def h(request):
    handle = HANDLES[request.param]()
    yield handle
    handle.close()


def _write_ref(path, size: int, offset: int = 0) -> torch.Tensor:
    t = random_tensor(size, torch.uint8, seed=size + offset)
    with open(path, "wb") as f:
        f.write(bytes(offset))
        f.write(t.numpy().tobytes())
    return t


@pytest.mark.parametrize("write_async", [False, True])
@pytest.mark.parametrize("read_async", [False, True])
def test_pread_pwrite_take_deepspeeds_async_keyword(h, tmp_path, write_async, read_async):
    t = random_tensor(30_000)
    path = str(tmp_path / "f")
    status = h.pwrite(buffer=t, filename=path, validate=True, file_offset=OFFSET,
                      **{"async": write_async})
    assert status == (0 if write_async else 1)
    assert h.wait() == (1 if write_async else 0)
    assert os.path.getsize(path) == OFFSET + t.nbytes
    back = torch.zeros_like(t)
    status = h.pread(buffer=back, filename=path, validate=False, file_offset=OFFSET,
                     **{"async": read_async})
    assert status == (0 if read_async else 1)
    assert h.wait() == (1 if read_async else 0)
    assert same_bytes(back, t)


def test_async_op_keyword_and_positional_flag_still_work(h, tmp_path):
    t = random_tensor(5000)
    path = str(tmp_path / "f")
    assert h.pwrite(t, path, False, async_op=True) == 0 and h.wait() == 1
    back = torch.zeros_like(t)
    assert h.pread(back, path, False, False, 0) == 1 and same_bytes(back, t)


def test_sync_async_read_write_methods_by_keyword(h, tmp_path):
    path = str(tmp_path / "f")
    t = random_tensor(20_000)
    assert h.sync_pwrite(buffer=t, filename=path, file_offset=OFFSET) == 1
    back = torch.zeros_like(t)
    assert h.sync_pread(buffer=back, filename=path, file_offset=OFFSET) == 1 and same_bytes(back, t)
    u = random_tensor(20_000, seed=1)
    assert h.async_pwrite(buffer=u, filename=path, file_offset=OFFSET) == 0 and h.wait() == 1
    back.zero_()
    assert h.async_pread(buffer=back, filename=path, file_offset=OFFSET) == 0 and h.wait() == 1
    assert same_bytes(back, u)
    whole = str(tmp_path / "whole")
    assert h.write(buffer=t, filename=whole, validate=True, file_offset=0) == 0
    back.zero_()
    assert h.read(buffer=back, filename=whole, validate=True, file_offset=0) == 0
    assert same_bytes(back, t)


def _open_for_write(path: str, direct: bool) -> int:
    flags = os.O_CREAT | os.O_WRONLY | (os.O_DIRECT if direct else 0)
    try:
        return os.open(path, flags)
    except OSError as exc:
        if direct and exc.errno == errno.EINVAL:
            pytest.skip("this file system refuses O_DIRECT")
        raise


@pytest.mark.parametrize("direct", [False, True])
def test_async_pwrite_to_a_descriptor_by_keyword_and_position(h, tmp_path, direct):
    path = str(tmp_path / "f")
    data = h.new_cpu_locked_tensor(4 * 4096, torch.empty(0, dtype=torch.uint8))
    data.copy_(random_tensor(4 * 4096, torch.uint8, seed=7))
    fd = _open_for_write(path, direct)
    try:
        assert h.async_pwrite(buffer=data[:4096], fd=fd, file_offset=0) == 0
        assert h.async_pwrite(data[4096:], fd, 4096) == 0
        assert h.wait() == 2
        os.fstat(fd)  # the caller's descriptor is left open
    finally:
        os.close(fd)
    with open(path, "rb") as f:
        assert f.read() == data.numpy().tobytes()
    h.free_cpu_locked_tensor(data)


def test_bad_keyword_combinations_are_type_errors_naming_the_arguments(h, tmp_path):
    t = random_tensor(1000)
    path = str(tmp_path / "f")
    with pytest.raises(TypeError, match=r"pread\(\) got both 'async_op' and 'async'"):
        h.pread(t, path, False, True, **{"async": True})
    with pytest.raises(TypeError, match=r"pwrite\(\) got both 'async_op' and 'async'"):
        h.pwrite(buffer=t, filename=path, validate=False, async_op=False, **{"async": False})
    with pytest.raises(TypeError, match=r"pwrite\(\) missing required argument 'async_op'"):
        h.pwrite(t, path, False)
    with pytest.raises(TypeError, match=r"pread\(\) got an unexpected keyword argument 'asynch'"):
        h.pread(t, path, False, True, asynch=True)
    with pytest.raises(TypeError, match=r"'async_op' must be a bool, got str"):
        h.pwrite(t, path, False, **{"async": "False"})
    fd = os.open(path, os.O_CREAT | os.O_WRONLY)
    try:
        with pytest.raises(TypeError, match=r"async_pwrite\(\) got both 'filename' and 'fd'"):
            h.async_pwrite(t, path, fd=fd)
        with pytest.raises(TypeError, match=r"argument 'fd' must be an int file descriptor, got bool"):
            h.async_pwrite(t, fd=True)
        with pytest.raises(TypeError, match=r"argument 'fd' must be an int file descriptor, got str"):
            h.async_pwrite(t, fd=str(fd))
    finally:
        os.close(fd)
    with pytest.raises(TypeError, match=r"async_pwrite\(\) missing required argument 'filename' \(or 'fd'\)"):
        h.async_pwrite(t)
    example = torch.empty(0)
    with pytest.raises(TypeError, match="got both 'example_tensor' and 'example_tenosr'"):
        h.new_cpu_locked_tensor(10, example, example_tenosr=example)
    with pytest.raises(TypeError, match="missing required argument 'example_tensor'"):
        h.new_cpu_locked_tensor(10)
    assert h.wait() == 0, "a rejected call must not leave an op behind"
    assert os.path.getsize(path) == 0


@pytest.mark.parametrize("form", ["deepspeed-keyword", "keyword", "positional", "dtype"])
def test_new_cpu_locked_tensor_spellings(h, tmp_path, form):
    example = torch.empty(0, dtype=torch.float16)
    if form == "deepspeed-keyword":
        t = h.new_cpu_locked_tensor(num_elem=5000, example_tenosr=example)
    elif form == "keyword":
        t = h.new_cpu_locked_tensor(num_elem=5000, example_tensor=example)
    elif form == "positional":
        t = h.new_cpu_locked_tensor(5000, example)
    else:
        t = h.new_cpu_locked_tensor(5000, torch.float16)
    assert t.dtype == torch.float16 and t.shape == (5000,) and t.device.type == "cpu"
    assert h.is_pinned(buffer=t) and h.is_pinned(t[100:200])
    t.copy_(random_tensor(5000, torch.float16))
    path = str(tmp_path / "f")
    assert h.sync_pwrite(buffer=t, filename=path) == 1
    back = torch.zeros_like(t)
    assert h.sync_pread(buffer=back, filename=path) == 1 and same_bytes(back, t)
    assert h.free_cpu_locked_tensor(tensor=t) is True
    assert t.numel() == 0 and not h.is_pinned(t)


def test_gds_device_tensor_methods_take_deepspeeds_names(tmp_path):
    h = fake_gds_handle_class()(block_size=4096)
    example = torch.empty(0, dtype=torch.int32)
    buf = h.new_pinned_device_tensor(num_elem=3000, example_tenosr=example)
    assert buf.dtype == torch.int32 and buf.numel() == 3000
    assert h.fake_cufile.registered == {buf.data_ptr(): 12_000}
    buf.copy_(random_tensor(3000, torch.int32))
    path = str(tmp_path / "f")
    assert h.pwrite(buffer=buf, filename=path, validate=False, **{"async": True}) == 0 and h.wait() == 1
    other = torch.zeros(3000, dtype=torch.int32)
    assert h.pin_device_tensor(tensor=other)
    assert h.pread(buffer=other, filename=path, validate=True, **{"async": False}) == 1
    assert same_bytes(other, buf)
    assert h.unpin_device_tensor(tensor=other)
    assert h.free_pinned_device_tensor(tensor=buf) and h.fake_cufile.registered == {}
    with pytest.raises(TypeError, match="new_pinned_device_tensor.*both 'example_tensor' and 'example_tenosr'"):
        h.new_pinned_device_tensor(10, example, example_tenosr=example)
    assert h.fake_cufile.registered == {}
    h.close()


# --- PinMemoryBuilder ----------------------------------------------------------------------


def test_pin_memory_builder_surface():
    assert "PinMemoryBuilder" in compat.__all__
    builder = compat.PinMemoryBuilder()
    assert builder.NAME == "pin_memory" and builder.is_compatible() is True
    loaded = builder.load()
    pin = loaded.pin_handle()
    t = pin.new_cpu_locked_tensor(num_elem=1000, example_tensor=torch.empty(0, dtype=torch.float64))
    assert t.dtype == torch.float64 and t.shape == (1000,)
    assert pin.is_pinned(buffer=t) and loaded.is_pinned(t) and pin.is_pinned(t.narrow(0, 10, 10))
    assert not pin.is_pinned(torch.empty(1000, dtype=torch.float64))
    assert loaded.free_cpu_locked_tensor(t) is True and not pin.is_pinned(t)
    u = loaded.new_cpu_locked_tensor(10, torch.empty(0))
    assert pin.free_cpu_locked_tensor(locked_tensor=u) is True
    assert pin.free_cpu_locked_tensor(locked_tensor=u) is False  # already released


def test_locked_memory_is_shared_between_pin_handle_and_io_handles(h, tmp_path):
    pin = compat.PinMemoryBuilder().load().pin_handle()
    from_pin = pin.new_cpu_locked_tensor(8192, torch.empty(0, dtype=torch.uint8))
    from_handle = h.new_cpu_locked_tensor(8192, torch.empty(0, dtype=torch.uint8))
    assert h.is_pinned(from_pin) and h.is_pinned(from_pin[4096:])
    assert pin.is_pinned(from_handle) and deepnvme.is_pinned(from_handle)
    # a buffer locked by the pin handle carries I/O through the handle
    path = str(tmp_path / "f")
    ref = _write_ref(path, 8192, offset=OFFSET)
    assert h.pread(buffer=from_pin, filename=path, validate=False, file_offset=OFFSET,
                   **{"async": True}) == 0 and h.wait() == 1
    assert same_bytes(from_pin, ref)
    # each side releases what the other locked
    assert h.free_cpu_locked_tensor(from_pin) is True and not pin.is_pinned(from_pin)
    assert pin.free_cpu_locked_tensor(from_handle) is True and not h.is_pinned(from_handle)


def test_free_by_address_unlocks_and_leaves_views_valid():
    pin = compat.PinMemoryBuilder().load().pin_handle()
    before = locked_bytes()
    t = pin.new_cpu_locked_tensor(3 * 4096, torch.empty(0, dtype=torch.uint8))
    t.fill_(7)
    address = t.untyped_storage().data_ptr()
    assert locked_bytes() - before == 3 * 4096
    assert pin.free_cpu_locked_tensor_by_ptr(address=address) is True
    assert locked_bytes() == before and not pin.is_pinned(t)
    assert int(t.sum()) == 7 * 3 * 4096  # the memory lives as long as the tensor
    assert pin.free_cpu_locked_tensor_by_ptr(address) is False  # nothing locked there now
    assert pin.free_cpu_locked_tensor_by_ptr(address + 4096) is False  # not an allocation base
    assert pin.free_cpu_locked_tensor(t) is True  # still deepnvme's memory: emptied now
