"""The tensor storages of a saved object, named by their key path (what stagers copy and
checksums name)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["named_storages"]


def named_storages(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.UntypedStorage]]:
    """Every tensor storage in nested dicts, lists and tuples, once, named by its key path
    (``"model/fc.weight"``, ``"optim/state/0/exp_avg"``), in iteration order. Tensors inside
    other objects are not reached."""
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [(prefix, obj)]
    while stack:
        name, value = stack.pop()
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage._cdata not in seen:
                seen.add(storage._cdata)
                yield name, storage
        elif isinstance(value, dict):
            stack.extend((f"{name}/{k}" if name else str(k), v) for k, v in reversed(value.items()))
        elif isinstance(value, (list, tuple)):
            stack.extend((f"{name}/{i}" if name else str(i), v)
                         for i, v in reversed(list(enumerate(value))))
