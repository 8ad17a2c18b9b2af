"""Byte views of tensors: the zero-copy bridge between torch tensors and the byte-level engine."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import overload

import torch

from ..errors import UnsupportedBufferError

__all__ = ["cast_to_byte_tensor", "byte_view", "check_io_tensor", "storage_bytes", "aligned_empty"]


@overload
def cast_to_byte_tensor(tensor: torch.Tensor) -> torch.Tensor: ...
@overload
def cast_to_byte_tensor(tensor: Sequence[torch.Tensor]) -> list[torch.Tensor]: ...


def cast_to_byte_tensor(tensor):  # type: ignore[no-untyped-def]
    """A 1-D ``uint8`` tensor aliasing ``tensor``'s bytes (no copy; it keeps the source alive).

    Accepts a list or tuple of tensors too, returning a list. The tensor must be contiguous.
    """
    if isinstance(tensor, (list, tuple)):
        return [cast_to_byte_tensor(t) for t in tensor]
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a tensor or a list of tensors, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise UnsupportedBufferError(
            f"cannot alias the bytes of a non-contiguous tensor (shape {tuple(tensor.shape)}, "
            f"stride {tensor.stride()}); call .contiguous() first")
    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def check_io_tensor(tensor: object, what: str = "buffer") -> torch.Tensor:
    """Raise a clear error unless ``tensor`` is a contiguous CPU tensor usable for file I/O."""
    if not isinstance(tensor, torch.Tensor):
        raise UnsupportedBufferError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise UnsupportedBufferError(
            f"{what} is on device {tensor.device}; handles take CPU and CUDA tensors only: "
            "copy it to one of those first")
    if not tensor.is_contiguous():
        raise UnsupportedBufferError(
            f"{what} is not contiguous (shape {tuple(tensor.shape)}, stride {tensor.stride()}); "
            "call .contiguous() first")
    return tensor


def byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable ``memoryview`` of a contiguous CPU tensor's bytes (does not keep it alive)."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def storage_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 CPU tensor aliasing a storage's bytes (CUDA storages are copied to CPU)."""
    if storage.device.type != "cpu":
        storage = storage.cpu()
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def aligned_empty(nbytes: int, file_offset: int = 0, alignment: int = 4096, *,
                  min_bytes: int = 64 * 1024) -> torch.Tensor:
    """An uninitialised uint8 tensor whose address is congruent to ``file_offset`` modulo ``alignment``.

    Its storage is exactly ``nbytes`` long (a view of a slightly larger allocation), so
    O_DIRECT reads of the data at ``file_offset`` land in it without bounce buffers. Below
    ``min_bytes`` (64 KiB) a plain allocation is returned (such reads are not worth aligning);
    ``min_bytes=0`` aligns every size.
    """
    if nbytes < min_bytes:
        return torch.empty(nbytes, dtype=torch.uint8)
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8).untyped_storage()
    pad = (file_offset - raw.data_ptr()) % alignment
    return torch.empty(0, dtype=torch.uint8).set_(raw[pad:pad + nbytes])
