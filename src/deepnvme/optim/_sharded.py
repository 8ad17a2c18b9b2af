"""The parameters the wrapped optimizer updates when the model is sharded with FSDP2.

An FSDP2 parameter is a DTensor; its offload (``offload_parameters`` on a ``fully_shard``-ed
model) holds this rank's shard of it and a plain local parameter over that shard. The wrapped
optimizer is built over the local parameters instead, so its state is plain tensors of the
shard's shape (what the swap files hold) and every update touches this rank's shard only:
element-wise, as torch's optimizers update a DTensor's local tensor.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from ._protocol import offload_of

__all__ = ["ShardedOffload", "gradient_sources", "local_parameters"]


@runtime_checkable
class ShardedOffload(Protocol):
    """An offload that holds shards of DTensor parameters."""

    def local_parameter(self, param: torch.Tensor) -> torch.nn.Parameter | None:
        """The plain parameter over this rank's shard of ``param``, or None."""
        ...

    def sharded_parameter(self, local: torch.Tensor) -> torch.nn.Parameter | None:
        """The DTensor parameter whose shard the plain parameter ``local`` holds, or None."""
        ...


def _is_dtensor(p: object) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed
        return False
    return isinstance(p, DTensor)


def _local(p: Any) -> Any:
    if not _is_dtensor(p):
        return p
    offload = offload_of(p)
    local = offload.local_parameter(p) if isinstance(offload, ShardedOffload) else None
    if local is None:
        raise ValueError(
            f"NVMeOptimizer got a DTensor parameter (shape {list(p.shape)}, e.g. of "
            "an FSDP2 model) that no offload holds; call offload_parameters on the "
            "fully_shard-ed model first: the optimizer then updates each rank's shards"
        )
    return local


def local_parameters(params: Iterable[Any]) -> list[Any]:
    """``params`` (tensors, or param group dicts) with each offloaded DTensor parameter
    replaced by its local parameter; other parameters pass through unchanged (a lone tensor
    too: the optimizer's own check refuses it)."""
    if isinstance(params, torch.Tensor):
        return params  # type: ignore[return-value]
    out: list[Any] = []
    for item in params:
        if isinstance(item, dict):
            group = dict(item)
            ps = group.get("params")
            if isinstance(ps, torch.Tensor):
                group["params"] = _local(ps)
            elif ps is not None:
                group["params"] = [_local(p) for p in ps]
            out.append(group)
        else:
            out.append(_local(item))
    return out


def gradient_sources(params: Iterable[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
    """The tensors whose post-accumulate-grad hooks see the gradients of ``params`` (the
    wrapped optimizer's): for an offloaded FSDP2 shard its DTensor parameter, whose hooks FSDP2
    runs after the reduce-scatter, else the parameter itself; and whether every one is such a
    shard (each gradient already reduced across the ranks when the hooks see it)."""
    sources: list[torch.Tensor] = []
    reduced = True
    for p in params:
        offload = offload_of(p)
        sharded = offload.sharded_parameter(p) if isinstance(offload, ShardedOffload) else None
        sources.append(p if sharded is None else sharded)
        reduced = reduced and sharded is not None
    return sources, reduced and bool(sources)
