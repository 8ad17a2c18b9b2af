"""``deepspeed.accelerator`` stand-in: a CUDA accelerator where torch sees a GPU, else CPU.

Mirrors the few behaviours the op tests rely on: CPU's ``pin_memory`` returns the tensor
unchanged and ``is_available()`` is True (as DeepSpeed's CPU accelerator does); CUDA pins with
torch. ``DS_ACCELERATOR=cpu|cuda`` forces one, as in DeepSpeed.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch


class Accelerator:
    """The subset of DeepSpeed's accelerator interface used by its I/O tests."""

    def __init__(self, name: str) -> None:
        if name not in ("cpu", "cuda"):
            raise ValueError(f"DS_ACCELERATOR must be 'cpu' or 'cuda' here, got {name!r}")
        self._name = name

    def device_name(self, device_index: int | None = None) -> str:
        return self._name if device_index is None else f"{self._name}:{device_index}"

    def is_available(self) -> bool:
        return True if self._name == "cpu" else torch.cuda.is_available()

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1, **_: Any) -> torch.Tensor:
        return tensor if self._name == "cpu" else tensor.pin_memory()

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return False if self._name == "cpu" else tensor.is_pinned()

    def synchronize(self, device_index: int | None = None) -> None:
        if self._name == "cuda":
            torch.cuda.synchronize(device_index)

    @property
    def ByteTensor(self) -> Callable[..., torch.Tensor]:  # DeepSpeed's name
        if self._name == "cpu":
            return torch.ByteTensor
        return functools.partial(torch.tensor, dtype=torch.uint8, device="cuda")


@functools.cache
def get_accelerator() -> Accelerator:
    name = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
    return Accelerator(name)


__all__ = ["Accelerator", "get_accelerator"]
