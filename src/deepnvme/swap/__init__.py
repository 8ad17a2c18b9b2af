"""Tensor swapping between memory and files on fast storage (ZeRO-Infinity style)."""

from ..errors import SwapBufferError, SwapError
from .swapper import TensorSwapper

__all__ = ["SwapBufferError", "SwapError", "TensorSwapper"]
