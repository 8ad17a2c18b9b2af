"""DeepSpeed's op-builder shapes, so ``AsyncIOBuilder().load().aio_handle(...)`` code runs as is.

This module only maps DeepSpeed's names and argument orders onto deepnvme; it implements nothing.
"""

from __future__ import annotations

import os
import types
from typing import Any

import torch

from ..io.posix import O_DIRECT
from ..memory import pinned
from ..memory.views import cast_to_byte_tensor
from .aio import AioHandle

__all__ = ["AsyncIOBuilder", "GDSBuilder", "PinHandle", "PinMemoryBuilder", "UtilsBuilder"]


class AsyncIOBuilder:
    """``deepspeed.ops.op_builder.AsyncIOBuilder`` look-alike: ``load()`` gives a module with
    ``aio_handle``."""

    NAME = "async_io"

    def is_compatible(self, verbose: bool = False) -> bool:
        """True where positional vectored I/O exists (Linux); no libaio or compiler needed."""
        return hasattr(os, "preadv") and hasattr(os, "pwritev") and O_DIRECT != 0

    def load(self, verbose: bool = True) -> types.SimpleNamespace:
        if not self.is_compatible():
            raise RuntimeError("deepnvme's async I/O needs os.preadv/os.pwritev and O_DIRECT (Linux)")
        return types.SimpleNamespace(aio_handle=AioHandle)


class GDSBuilder:
    """``GDSBuilder`` look-alike; GPUDirect Storage needs CUDA and cuFile."""

    NAME = "gds"

    def is_compatible(self, verbose: bool = False) -> bool:
        """True where CUDA, the cuFile binding and its driver are usable (opens the driver)."""
        cls = _gds_handle_class()
        return torch.cuda.is_available() and cls is not None and cls.status().available

    def load(self, verbose: bool = True) -> types.SimpleNamespace:
        if not torch.cuda.is_available():
            raise RuntimeError("GDSBuilder: GPUDirect Storage needs a CUDA device, and torch "
                               f"{torch.__version__} sees none; use AsyncIOBuilder for CPU tensors")
        cls = _gds_handle_class()
        if cls is None:
            raise RuntimeError("GDSBuilder: deepnvme's GdsHandle is not available in this version; "
                               "use AsyncIOBuilder, which stages CUDA tensors through pinned memory")
        status = cls.status()
        if not status.available:
            raise RuntimeError(f"GDSBuilder: GPUDirect Storage is unavailable: {status.detail}")
        return types.SimpleNamespace(gds_handle=cls)


def _gds_handle_class() -> Any:
    try:
        from . import gds
    except ImportError:
        return None
    return getattr(gds, "GdsHandle", None)


class UtilsBuilder:
    """``UtilsBuilder`` look-alike: ``load().cast_to_byte_tensor(t_or_list)``."""

    NAME = "utils"

    def is_compatible(self, verbose: bool = False) -> bool:
        return True

    def load(self, verbose: bool = True) -> types.SimpleNamespace:
        return types.SimpleNamespace(cast_to_byte_tensor=cast_to_byte_tensor)


class PinHandle:
    """DeepSpeed's ``pin_handle``: page-locked CPU tensors from :mod:`deepnvme.memory.pinned`.

    Stateless: the locked memory is process-wide, so a tensor locked here is ``is_pinned`` for
    every deepnvme handle and a tensor from ``handle.new_cpu_locked_tensor`` is for this one.
    """

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: torch.Tensor | torch.dtype
                              ) -> torch.Tensor:
        """A 1-D page-locked CPU tensor of ``num_elem`` elements with the example's dtype."""
        return pinned.new_cpu_locked_tensor(num_elem, example_tensor)

    def free_cpu_locked_tensor(self, locked_tensor: torch.Tensor) -> bool:
        """Unlock and empty a locked tensor now; False if deepnvme did not lock it."""
        return pinned.free_cpu_locked_tensor(locked_tensor)

    def free_cpu_locked_tensor_by_ptr(self, address: int) -> bool:
        """Unlock a locked allocation by its base address; False if none starts there
        (:func:`deepnvme.memory.pinned.free_locked_address`)."""
        return pinned.free_locked_address(address)

    def is_pinned(self, buffer: torch.Tensor) -> bool:
        """True for CUDA-pinned tensors and memory locked by deepnvme, views included."""
        return pinned.is_pinned(buffer)


class PinMemoryBuilder:
    """``PinMemoryBuilder`` look-alike: ``load().pin_handle()`` as in DeepSpeed; the loaded
    namespace also has the handle's four methods directly (``load().is_pinned(t)``)."""

    NAME = "pin_memory"

    def is_compatible(self, verbose: bool = False) -> bool:
        """True on POSIX systems (anonymous mmap and mlock); no compiler needed."""
        return os.name == "posix"

    def load(self, verbose: bool = False) -> types.SimpleNamespace:
        if not self.is_compatible():
            raise RuntimeError(f"deepnvme's locked memory needs a POSIX system (mmap, mlock); "
                               f"this is {os.name!r}")
        h = PinHandle()
        return types.SimpleNamespace(pin_handle=PinHandle,
                                     new_cpu_locked_tensor=h.new_cpu_locked_tensor,
                                     free_cpu_locked_tensor=h.free_cpu_locked_tensor,
                                     free_cpu_locked_tensor_by_ptr=h.free_cpu_locked_tensor_by_ptr,
                                     is_pinned=h.is_pinned)
