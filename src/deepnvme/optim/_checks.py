"""Checks of NVMeOptimizer's arguments and of its writes, with errors that say what to write."""

from __future__ import annotations

import torch

from ._protocol import offload_of
from ._state import Writes
from ._subgroups import Member

__all__ = ["check_arguments", "check_cpu", "raise_failed_writes"]

_USAGE = "NVMeOptimizer(model.parameters(), torch.optim.AdamW, swap_dir=..., lr=...)"


def check_arguments(params: object, optimizer_cls: object) -> None:
    """Refuse the natural misreadings of the signature with the call to write instead."""
    if isinstance(params, torch.optim.Optimizer):
        name = type(params).__name__
        raise TypeError(f"NVMeOptimizer builds the optimizer itself: pass the parameters and the "
                        f"optimizer class with its options, e.g. {_USAGE}, not an optimizer "
                        f"object (got {name}; to carry its param groups over: NVMeOptimizer("
                        f"optimizer.param_groups, type(optimizer), swap_dir=...))")
    if isinstance(params, torch.nn.Module):
        raise TypeError(f"NVMeOptimizer takes the model's parameters, not the "
                        f"{type(params).__name__} module: {_USAGE}")
    if isinstance(optimizer_cls, torch.optim.Optimizer):
        raise TypeError(f"optimizer_cls must be an optimizer class such as torch.optim.AdamW, "
                        f"not an optimizer object (got {type(optimizer_cls).__name__}); pass its "
                        f"options as keyword arguments: {_USAGE}")
    if not callable(optimizer_cls):
        raise TypeError(f"optimizer_cls must be an optimizer class such as torch.optim.AdamW, "
                        f"got {type(optimizer_cls).__name__}: {_USAGE}")


def check_cpu(params: list[Member]) -> None:
    for gi, p in params:   # an offload's parameters are updated on its host copies
        if p.device.type != "cpu" and offload_of(p) is None:
            raise ValueError(f"NVMeOptimizer needs CPU parameters (with the master copy and the "
                             f"update on the CPU, as in ZeRO-Infinity's CPU optimizer); a "
                             f"parameter of group {gi} is on {p.device}")


def raise_failed_writes(writes: Writes) -> None:
    """Raise the error of the first write that failed already (without waiting)."""
    for _, fut in writes:
        exc = fut.exception() if fut.done() else None
        if exc is not None:
            raise exc
