"""``GdsHandle``: DeepSpeed's ``gds_handle`` surface over NVIDIA cuFile (GPUDirect Storage).

CUDA tensors move between files and device memory with ``cuFileRead``/``cuFileWrite`` through
NVIDIA's maintained binding ``cuda.bindings.cufile`` (package ``cuda-bindings``; install the
``gds`` extra). With the nvidia-fs kernel driver loaded cuFile DMAs straight between NVMe and
GPU memory ("nvidia-fs" mode); without it cuFile runs in its compatibility mode (POSIX I/O
through its own bounce buffers). :func:`gds_status` and :attr:`GdsHandle.mode` say which.

CPU tensors given to a GdsHandle take the AioHandle path. Nothing is imported or initialised
until the first CUDA op (or :func:`gds_status`): a GdsHandle can be built on a machine without
CUDA, and then serves CPU tensors exactly like an AioHandle; a CUDA op there raises
:class:`GdsUnavailableError`. cuFile failures raise :class:`~deepnvme.errors.DeepNVMeIOError`
naming the file, offset and size (DeepSpeed exits the process instead).

Why ``cuda.bindings.cufile`` rather than KvikIO: its calls are thin, synchronous and release
the GIL, so cuFile is one more mover of the one engine (:mod:`deepnvme.io.cufile`), with no
second thread pool or task-size policy to tune; it is NVIDIA's maintained binding of the C API. This
was not (yet) chosen by measurement: ``benchmarks/bench_gpu.py`` runs KvikIO side by side.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import threading
from typing import Any

import torch

from ..errors import DeepNVMeError, GdsUnavailableError
from ..io.cufile import BufferRegistry, CudaOrder, CuFileIO, DeviceOrder, counted_binding
from ._deepspeed_args import example_arg
from .aio import AioHandle

__all__ = ["GdsHandle", "GdsStatus", "GdsUnavailableError", "gds_status"]

log = logging.getLogger(__name__)
_NVFS_PATHS = ("/sys/module/nvidia_fs", "/proc/driver/nvidia-fs")


@dataclasses.dataclass(frozen=True)
class GdsStatus:
    """Whether cuFile is usable, in which ``mode`` ("nvidia-fs" or "compatibility"), and why not."""

    available: bool
    mode: str | None
    detail: str


def _import_cufile() -> Any:
    try:
        from cuda.bindings import cufile
    except ImportError as exc:
        raise GdsUnavailableError(
            f"GPUDirect Storage needs NVIDIA's cuFile binding: pip install 'deepnvme[gds]' "
            f"(cuda-bindings >= 12.9.1 with libcufile) ({exc})") from None
    return cufile


def nvidia_fs_loaded() -> bool:
    """True when the nvidia-fs kernel module is loaded (true GPUDirect DMA is possible)."""
    return any(os.path.exists(p) for p in _NVFS_PATHS)


def _forced_compat(cufile: Any) -> bool:
    """cufile.json's ``force_compat_mode``, where this binding version can read it."""
    enum = getattr(cufile, "BoolConfigParameter", None)
    param = getattr(enum, "FORCE_COMPAT_MODE", None) or getattr(enum, "PARAM_FORCE_COMPAT_MODE", None)
    getter = getattr(cufile, "get_parameter_bool", None)
    if param is None or getter is None:
        return False
    try:
        return bool(getter(int(param)))
    except Exception as exc:  # noqa: BLE001 - only refines the reported mode
        log.debug("deepnvme: cannot read cuFile force_compat_mode: %s", exc)
        return False


class _Driver:
    """The process-wide cuFile driver session, opened once on first use (thread-safe)."""

    _lock = threading.Lock()
    _module: Any = None
    _mode: str | None = None

    @classmethod
    def open(cls) -> tuple[Any, str]:
        with cls._lock:
            if cls._module is None:
                if not torch.cuda.is_available():
                    raise GdsUnavailableError(
                        f"GPUDirect Storage needs a CUDA device and torch {torch.__version__} "
                        "sees none; CPU tensors still work through the aio path")
                module = _import_cufile()
                try:
                    module.driver_open()
                except Exception as exc:
                    raise GdsUnavailableError(f"cuFileDriverOpen failed: {exc}; check "
                                              "/etc/cufile.json (allow_compat_mode) and "
                                              "`gdscheck -p`") from exc
                cls._module = counted_binding(module)
                gds = nvidia_fs_loaded() and not _forced_compat(module)
                cls._mode = "nvidia-fs" if gds else "compatibility"
                log.info("deepnvme: cuFile driver open, %s mode", cls._mode)
            return cls._module, cls._mode  # type: ignore[return-value]


def _register_probe(cufile: Any, directory: str) -> str | None:
    """Register a new file in ``directory`` with cuFile (and deregister it); None if that
    works, else why not. The driver opening is not enough: a file system or configuration
    that cuFile refuses fails at registration."""
    fd, path = tempfile.mkstemp(prefix=".deepnvme-gds-probe-", dir=directory)
    try:
        direct = -1
        with contextlib.suppress(OSError):
            direct = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
        descr = cufile.Descr()
        descr.type = cufile.FileHandleType.OPAQUE_FD
        descr.handle.fd = direct if direct >= 0 else fd
        descr.fs_ops = 0
        try:
            fh = cufile.handle_register(descr.ptr)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            return (f"cuFileHandleRegister refused a file in {directory}: {exc}; see cufile.log "
                    "there or in the working directory, and cufile.json (allow_compat_mode)")
        finally:
            if direct >= 0:
                os.close(direct)
        with contextlib.suppress(Exception):
            cufile.handle_deregister(fh)
        return None
    finally:
        os.close(fd)
        os.unlink(path)


def gds_status(directory: str | os.PathLike[str] | None = None) -> GdsStatus:
    """Probe GPUDirect Storage: opens the cuFile driver (once per process) if it can, then
    registers a scratch file in ``directory`` (default: the temporary directory), since a
    file system cuFile refuses fails only there."""
    try:
        cufile, mode = _Driver.open()
    except GdsUnavailableError as exc:
        return GdsStatus(False, None, str(exc))
    where = os.fspath(directory) if directory is not None else tempfile.gettempdir()
    try:
        refused = _register_probe(cufile, where)
    except OSError as exc:
        refused = f"cannot create a probe file in {where}: {exc}"
    if refused is not None:
        return GdsStatus(False, mode, refused)
    hint = ("nvidia-fs loaded: DMA between storage and GPU memory" if mode == "nvidia-fs" else
            "nvidia-fs not loaded: cuFile compatibility mode (POSIX I/O via host bounce buffers)")
    return GdsStatus(True, mode, hint)


class GdsHandle(AioHandle):
    """DeepSpeed's ``gds_handle``: the :class:`AioHandle` surface (same arguments, return
    values, futures, ``wait()`` counting and errors) with CUDA tensors moved by cuFile, plus
    ``new_pinned_device_tensor``/``free_pinned_device_tensor``/``pin_device_tensor``/
    ``unpin_device_tensor``. No bounce memory of its own; cuFile's is set in cufile.json.
    """

    def __init__(self, block_size: int | None = None, queue_depth: int | None = None,
                 single_submit: bool | None = None, overlap_events: bool | None = None,
                 intra_op_parallelism: int | None = None, **kwargs: Any) -> None:
        super().__init__(block_size, queue_depth, single_submit, overlap_events,
                         intra_op_parallelism, **kwargs)
        self._registry = BufferRegistry()

    # hooks a test subclass replaces to run the cuFile path on CPU with a fake binding
    def _load_cufile(self) -> tuple[Any, str]:
        return _Driver.open()

    def _new_order(self) -> DeviceOrder:
        return CudaOrder()

    def _staging(self) -> Any:
        """The route for CUDA tensors: the engine with the cuFile mover (made on first use)."""
        with self._lock:
            if self._staging_pipeline is None:
                if self._closed:
                    raise RuntimeError("this handle is closed; create a new one")
                cufile, _ = self._load_cufile()
                self._staging_pipeline = CuFileIO(  # type: ignore[assignment]
                    self.config, cufile, self._new_order(), self._registry,
                    posix=self._engine.posix)
            return self._staging_pipeline

    @staticmethod
    def status() -> GdsStatus:
        """:func:`gds_status`: can cuFile run here, and in which mode."""
        return gds_status()

    @property
    def mode(self) -> str:
        """"nvidia-fs" or "compatibility" (opens the cuFile driver; raises if unavailable)."""
        return self._load_cufile()[1]

    # --- DeepSpeed's device-memory registration ---------------------------------------------

    def pin_device_tensor(self, tensor: torch.Tensor) -> bool:
        """Register a contiguous CUDA tensor with cuFile (``cuFileBufRegister``) so later I/O
        into it skips cuFile's internal bounce copy. Returns True; raises on failure."""
        self._check_buffer(tensor)
        if tensor.device.type not in self._STAGED_DEVICE_TYPES:
            raise DeepNVMeError(f"pin_device_tensor needs a CUDA tensor, got one on {tensor.device}")
        cufile, _ = self._load_cufile()
        base, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        try:
            cufile.buf_register(base, nbytes, 0)
        except Exception as exc:
            raise DeepNVMeError(f"cuFileBufRegister of {nbytes} bytes at {base:#x} failed: {exc}") from exc
        self._registry.add(base, nbytes)
        return True

    def unpin_device_tensor(self, tensor: torch.Tensor) -> bool:
        """Deregister a tensor registered by :meth:`pin_device_tensor`; False if it was not."""
        base = tensor.data_ptr()
        if self._registry.pop(base) is None:
            return False
        cufile, _ = self._load_cufile()
        try:
            cufile.buf_deregister(base)
        except Exception as exc:
            raise DeepNVMeError(f"cuFileBufDeregister at {base:#x} failed: {exc}") from exc
        return True

    def new_pinned_device_tensor(self, num_elem: int,
                                 example_tensor: torch.Tensor | torch.dtype | None = None, *,
                                 example_tenosr: torch.Tensor | torch.dtype | None = None
                                 ) -> torch.Tensor:
        """A new 1-D device tensor of ``num_elem`` elements (dtype, and device if CUDA, from the
        example; ``example_tenosr`` is DeepSpeed's spelling of the keyword), registered with
        cuFile. Release it with :meth:`free_pinned_device_tensor`."""
        example = example_arg("new_pinned_device_tensor", example_tensor, example_tenosr)
        dtype = example.dtype if isinstance(example, torch.Tensor) else example
        device: Any = "cuda"
        if isinstance(example, torch.Tensor) and example.device.type in self._STAGED_DEVICE_TYPES:
            device = example.device
        tensor = torch.empty(num_elem, dtype=dtype, device=device)
        self.pin_device_tensor(tensor)
        return tensor

    def free_pinned_device_tensor(self, tensor: torch.Tensor) -> bool:
        """Deregister and release a tensor from :meth:`new_pinned_device_tensor` (emptied in
        place; its memory returns to torch's allocator). False if it was not registered."""
        if not self.unpin_device_tensor(tensor):
            return False
        tensor.set_(torch.empty(0, dtype=tensor.dtype, device=tensor.device).untyped_storage())
        return True

    def close(self) -> None:
        """Finish outstanding ops, stop threads and deregister every pinned device range."""
        super().close()
        for base in self._registry.bases():
            self._registry.pop(base)
            with contextlib.suppress(GdsUnavailableError):
                cufile, _ = self._load_cufile()
                cufile.buf_deregister(base)

    def __repr__(self) -> str:
        return "Gds" + super().__repr__()[3:]
