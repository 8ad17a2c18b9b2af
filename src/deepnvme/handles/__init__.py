"""Tensor I/O handles: :class:`AioHandle` (any CPU or CUDA tensor through the engine),
:class:`GdsHandle` (GPUDirect Storage through cuFile) and DeepSpeed's op-builder shapes."""

from ..errors import GdsUnavailableError
from .aio import AioHandle, wait_all
from .gds import GdsHandle, gds_status

__all__ = ["AioHandle", "GdsHandle", "GdsUnavailableError", "gds_status", "wait_all"]
