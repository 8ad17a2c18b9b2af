"""Fakes for the GPU paths that run on CPU: a device copier and a file, both with delays.

CPU tensors stand in for device memory, so the staging pipeline's logic (ordering, overlap,
buffer reuse, error propagation) is exercised without CUDA.
"""

from __future__ import annotations

import errno
import os
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

import deepnvme
from deepnvme.errors import DeepNVMeIOError, ShortTransferError
from deepnvme.io.posix import Posix
from deepnvme.memory.heap import mapped_empty
from deepnvme.offload._entry import placeholder


class FakeCopier:
    """Copies on one background thread (in order, like a CUDA stream) after ``delay`` seconds.

    ``log`` holds ``(kind, staging_ptr, start, end)`` per copy; ``fail_at`` makes that call's
    event raise at synchronize. ``active`` counts copies started and not yet synchronised.
    """

    def __init__(self, *, delay: float = 0.0, fail_at: int | None = None) -> None:
        self.delay, self.fail_at = delay, fail_at
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="fake-copy")
        self.log: list[tuple[str, int, float, float]] = []
        self.calls = 0
        self.begun = 0
        self.active = 0
        self.lock = threading.Lock()

    def begin(self, device_tensor: torch.Tensor) -> object:
        self.begun += 1
        return ("ticket", device_tensor.device)

    def _copy(self, kind: str, ticket: object, dst: torch.Tensor, src: torch.Tensor) -> Future:
        assert ticket[0] == "ticket" and dst.numel() == src.numel()
        with self.lock:
            n = self.calls
            self.calls += 1
            self.active += 1
        staging = dst if kind == "to_host" else src

        def run() -> None:
            t0 = time.monotonic()
            if self.delay:
                time.sleep(self.delay)
            if n == self.fail_at:
                raise RuntimeError("fake device copy failure")
            dst.copy_(src)
            self.log.append((kind, staging.data_ptr(), t0, time.monotonic()))

        return self.pool.submit(run)

    def to_host(self, ticket, dst, src):
        return self._copy("to_host", ticket, dst, src)

    def to_device(self, ticket, dst, src):
        return self._copy("to_device", ticket, dst, src)

    def synchronize(self, event: Future) -> None:
        try:
            event.result()
        finally:
            with self.lock:
                self.active -= 1

    def close(self) -> None:
        self.pool.shutdown()


class FakeDevice:
    """A ``ComputeDevice`` (deepnvme.offload._device) whose device memory is the CPU's, for the
    device path of the parameter offload: separate device buffers, every copy on a background
    thread (one per direction, in order, like a side stream) after ``delay`` seconds, events as
    futures. Compute is synchronous on the CPU, so the compute stream waiting for an event
    blocks until the copy ran; a device buffer starts filled with 0xFF bytes (NaN), so a use
    before its copy shows.

    ``live_bytes``/``peak_bytes``: device buffers alive (their uint8 tensors not collected);
    ``copies``: ``(direction, nbytes)`` per copy issued.
    """

    def __init__(self, *, delay: float = 0.0) -> None:
        self.device = torch.device("cpu")
        self.delay = delay
        self._in = ThreadPoolExecutor(1, thread_name_prefix="fake-h2d")
        self._out = ThreadPoolExecutor(1, thread_name_prefix="fake-d2h")
        self.copies: list[tuple[str, int]] = []
        self.live_bytes = 0
        self.peak_bytes = 0
        self.lock = threading.Lock()

    def empty(self, nbytes: int) -> torch.Tensor:
        t = torch.full((nbytes,), 0xFF, dtype=torch.uint8)
        with self.lock:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(t, self._freed, nbytes)
        return t

    def _freed(self, nbytes: int) -> None:
        with self.lock:
            self.live_bytes -= nbytes

    def host_empty(self, nbytes: int) -> torch.Tensor:
        return mapped_empty(nbytes)

    def placeholder(self, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        return placeholder(shape, dtype)

    def _copy(self, pool: ThreadPoolExecutor, kind: str, dst: torch.Tensor,
              src: torch.Tensor) -> Future:
        self.copies.append((kind, dst.numel() * dst.element_size()))

        def run() -> None:
            if self.delay:
                time.sleep(self.delay)
            dst.copy_(src)
        return pool.submit(run)

    def to_device(self, dst: torch.Tensor, src: torch.Tensor, *, after: object) -> Future:
        assert after is None   # compute on the CPU is synchronous: nothing to wait for
        return self._copy(self._in, "to_device", dst, src)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Future:
        return self._copy(self._out, "to_host", dst, src)

    def compute_wait(self, event: Future | None) -> None:
        if event is not None:
            event.result()

    def compute_mark(self) -> None:
        return None

    def done(self, event: Future | None) -> bool:
        return event is None or event.done()

    def synchronize(self, event: Future | None) -> None:
        if event is not None:
            event.result()

    def close(self) -> None:
        self._in.shutdown()
        self._out.shutdown()


class FakeFileIO:
    """``submit_io`` over an in-memory file, ``workers`` at a time, each call taking ``delay`` s.

    ``fail_at`` (call index) raises an ``EIO`` DeepNVMeIOError from that call.
    """

    def __init__(self, data: bytes = b"", *, delay: float = 0.0, workers: int = 4,
                 fail_at: int | None = None) -> None:
        self.data = bytearray(data)
        self.delay, self.fail_at = delay, fail_at
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="fake-io")
        self.log: list[tuple[str, int, int, int, float, float]] = []  # kind, ptr, offset, n, t0, t1
        self.calls: list[tuple[bool, int, int, bool, bool]] = []  # write, offset, n, validate, fsync
        self.active = 0
        self.lock = threading.Lock()

    def __call__(self, write: bool, host: torch.Tensor, target, offset: int, *, validate: bool,
                 fsync: bool) -> Future:
        n = host.numel()
        with self.lock:
            index = len(self.calls)
            self.calls.append((write, offset, n, validate, fsync))
            self.active += 1

        def run() -> int:
            try:
                t0 = time.monotonic()
                if self.delay and n:
                    time.sleep(self.delay)
                if index == self.fail_at:
                    raise DeepNVMeIOError("read failed: fake EIO", path=str(target), offset=offset,
                                          size=n, errno=5)
                if write:
                    end = offset + n
                    if len(self.data) < end:
                        self.data.extend(bytes(end - len(self.data)))
                    self.data[offset:end] = bytes(host.numpy())
                else:
                    if offset + n > len(self.data):
                        raise ShortTransferError("unexpected end of file", path=str(target),
                                                 offset=offset, size=n, transferred=0)
                    if n:
                        host.copy_(torch.frombuffer(bytearray(self.data[offset:offset + n]), dtype=torch.uint8))
                self.log.append(("write" if write else "read", host.data_ptr(), offset, n, t0, time.monotonic()))
                return n
            finally:
                with self.lock:
                    self.active -= 1

        return self.pool.submit(run)

    def close(self) -> None:
        self.pool.shutdown()


class FakeStagedHandle(deepnvme.AioHandle):
    """An AioHandle that sends CPU tensors through the staging pipeline with a FakeCopier,
    small chunks and two buffers, so CPU tests cover the CUDA route of the handle."""

    _STAGED_DEVICE_TYPES = ("cpu",)
    chunk_bytes = 16384
    copy_delay = 0.0

    def _new_copier(self):
        return FakeCopier(delay=self.copy_delay)

    def _staging_options(self):
        return {"chunk_bytes": self.chunk_bytes, "buffers": 2, "alignment": self.config.alignment}


class FakeCuFileError(Exception):
    """Stands in for ``cuda.bindings.cufile.cuFileError``."""


class FakeCuFile:
    """The subset of ``cuda.bindings.cufile`` GdsHandle uses, over host memory and POSIX I/O.

    ``fail_at`` makes that read/write call raise; ``short_at`` makes it return one byte less.
    """

    class FileHandleType:
        OPAQUE_FD = 1

    class Descr:
        _next = [1000]
        table: dict = {}

        def __init__(self):
            self.type = None
            self.fs_ops = None
            self.handle = type("H", (), {"fd": -1})()
            self.ptr = FakeCuFile.Descr._next[0]
            FakeCuFile.Descr._next[0] += 1
            FakeCuFile.Descr.table[self.ptr] = self

    def __init__(self, *, fail_at: int | None = None, short_at: int | None = None) -> None:
        self.fail_at, self.short_at = fail_at, short_at
        self.handles: dict[int, int] = {}
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int, int, int, int]] = []  # op, base, size, file_offset, buf_offset
        self.lock = threading.Lock()
        self.opened = 0

    def driver_open(self):
        self.opened += 1

    def handle_register(self, descr_ptr):
        d = FakeCuFile.Descr.table.pop(descr_ptr)
        assert d.type == FakeCuFile.FileHandleType.OPAQUE_FD and d.fs_ops == 0
        with self.lock:
            fh = 1 + len(self.handles) + sum(1 for _ in self.calls)
            while fh in self.handles:
                fh += 1
            self.handles[fh] = d.handle.fd
        return fh

    def handle_deregister(self, fh):
        with self.lock:
            del self.handles[fh]

    def buf_register(self, base, length, flags):
        if base in self.registered:
            raise FakeCuFileError("MEMORY_ALREADY_REGISTERED")
        self.registered[base] = length

    def buf_deregister(self, base):
        if self.registered.pop(base, None) is None:
            raise FakeCuFileError("MEMORY_NOT_REGISTERED")

    def _io(self, op, fh, base, size, file_offset, buf_offset):
        import ctypes
        with self.lock:
            index = len(self.calls)
            self.calls.append((op, base, size, file_offset, buf_offset))
            fd = self.handles[fh]
        if index == self.fail_at:
            raise FakeCuFileError("CU_FILE_IO_ERROR (fake)")
        if base in self.registered:
            assert buf_offset + size <= self.registered[base]
        else:
            assert buf_offset == 0
        address = base + buf_offset
        if op == "read":
            data = _pread_any(fd, size, file_offset)
            ctypes.memmove(address, data, len(data))
            n = len(data)
        else:
            n = _pwrite_any(fd, ctypes.string_at(address, size), file_offset)
        return n - 1 if index == self.short_at else n

    def read(self, fh, base, size, file_offset, buf_offset):
        return self._io("read", fh, base, size, file_offset, buf_offset)

    def write(self, fh, base, size, file_offset, buf_offset):
        return self._io("write", fh, base, size, file_offset, buf_offset)


def _reopen(fd: int, flags: int) -> int:
    import os
    return os.open(f"/proc/self/fd/{fd}", flags | os.O_CLOEXEC)


def _pread_any(fd: int, size: int, offset: int) -> bytes:
    """pread through a buffered descriptor of the same file (the fd may be O_DIRECT)."""
    import os
    b = _reopen(fd, os.O_RDONLY)
    try:
        return os.pread(b, size, offset)
    finally:
        os.close(b)


def _pwrite_any(fd: int, data: bytes, offset: int) -> int:
    import os
    b = _reopen(fd, os.O_WRONLY)
    try:
        return os.pwrite(b, data, offset)
    finally:
        os.close(b)


class _FakeOrder:
    def __init__(self):
        self.begun = 0

    def begin(self, tensor):
        self.begun += 1
        return "ticket"

    def ready(self, ticket):
        assert ticket == "ticket"

    def guard(self, tensor):
        import contextlib
        return contextlib.nullcontext()


def fake_gds_handle_class():
    """A GdsHandle whose cuFile path serves CPU tensors through :class:`FakeCuFile`."""
    from deepnvme.handles.gds import GdsHandle

    class FakeGdsHandle(GdsHandle):
        _STAGED_DEVICE_TYPES = ("cpu",)

        def __init__(self, *args, cufile=None, **kwargs):
            super().__init__(*args, **kwargs)
            self.fake_cufile = cufile or FakeCuFile()
            self.fake_order = _FakeOrder()

        def _load_cufile(self):
            return self.fake_cufile, "compatibility"

        def _new_order(self):
            return self.fake_order

    return FakeGdsHandle


class FullDisk(Posix):
    """Writes to files whose name ends with one of ``full`` fail with ENOSPC."""

    def __init__(self) -> None:
        self.full: set[str] = set()

    def pwritev(self, fd, buffers, offset):
        if any(os.readlink(f"/proc/self/fd/{fd}").endswith(n) for n in self.full):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().pwritev(fd, buffers, offset)


def copy_named_weights(module: torch.nn.Module, weights) -> set[str]:
    """A serving engine's ``model.load_weights`` for stand-in models: copy each ``(name, tensor)``
    into the parameter of that name; return the names loaded."""
    params = dict(module.named_parameters())
    loaded = set()
    for name, tensor in weights:
        params[name].data.copy_(tensor)
        loaded.add(name)
    return loaded


def tiny_llama(folder, dtype: torch.dtype, *, layers: int) -> str:
    """A random Llama (hidden 128, MLP 256, vocab 256, 2 heads, 1 KV head) saved in ``dtype`` as
    several safetensors shards named by ``model.safetensors.index.json``; returns the folder."""
    import os

    import transformers
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).to(dtype).save_pretrained(folder, max_shard_size="300KB")
    shards = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
    assert len(shards) >= 2 and os.path.exists(os.path.join(folder, "model.safetensors.index.json"))
    return str(folder)


def in_process_vllm():
    """vLLM set up for the tests (engine in this process, 1 GiB KV cache, no hub access), or the
    calling test module skipped where vLLM is not installed (the environment stays untouched)."""
    import importlib.util

    import pytest
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed (tools/test_vllm.sh builds its side environment)",
                    allow_module_level=True)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return pytest.importorskip("vllm")
