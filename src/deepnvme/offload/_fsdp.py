"""FSDP2's side of an offload: the shards a rank holds, and where its all-gathers read them.

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each parameter as a DTensor whose local
tensor is this rank's shard: a view of a padded flat tensor (``FSDPParam._sharded_param_data``)
that the group's all-gather copies from. Forward and backward use the unsharded parameters that
the all-gather builds, never the shard. An offloaded shard is an entry of the store whose
stored tensor is the padded shard; a :class:`Shard` points both FSDP tensors (``Tensor.set_``,
no copy) and a plain local parameter (what :class:`~deepnvme.NVMeOptimizer` updates) at the
store's buffer while it is present, and at a placeholder otherwise.

Every all-gather of a parameter group goes through ``FSDPParamGroup.unshard`` (its pre-forward
and pre-backward hooks, FSDP's forward and backward prefetches, ``FSDPModule.unshard``);
:func:`wrap_unshard` wraps it per group so the shards are fetched before the copy into the
all-gather buffer and unpinned once it returns. These are FSDP2 internals: :func:`fsdp_groups`
checks the attributes it relies on and names what is missing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._entry import placeholder

__all__ = ["Group", "Shard", "fsdp_groups", "is_sharded_model", "shard_model", "wrap_unshard"]

_PARAM_ATTRS = ("sharded_param", "_sharded_param_data", "padded_sharded_param_size")


def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:   # a torch without FSDP2
        return None
    return FSDPModule


def is_sharded_model(model: torch.nn.Module) -> bool:
    """True if ``fully_shard`` was applied to ``model`` or one of its submodules."""
    cls = _fsdp_module_class()
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


@dataclass
class Group:
    """One FSDP2 parameter group: the module that owns it and FSDP's group object."""

    name: str          # the owning module's qualified name ("" for the root)
    group: Any         # FSDPParamGroup
    params: list[Any]  # its FSDPParam objects


def fsdp_groups(model: torch.nn.Module) -> list[Group]:
    """The parameter groups of a ``fully_shard``-ed model, in module order (each once)."""
    cls = _fsdp_module_class()
    out: list[Group] = []
    seen: set[int] = set()
    for name, module in model.named_modules():
        if cls is None or not isinstance(module, cls):
            continue
        state = module._get_fsdp_state()  # type: ignore[attr-defined]
        groups = getattr(state, "_fsdp_param_groups", None)
        if groups is None:
            single = getattr(state, "_fsdp_param_group", None)
            groups = [] if single is None else [single]
        for group in groups:
            if id(group) in seen:
                continue
            seen.add(id(group))
            params = list(getattr(group, "fsdp_params", None) or [])
            missing = [a for a in ("unshard", "is_sharded", "_all_gather_result") if not hasattr(group, a)]
            missing += [a for p in params[:1] for a in _PARAM_ATTRS if not hasattr(p, a)]
            if missing:
                raise RuntimeError(f"offload_parameters: this torch's FSDP2 lacks {missing} on "
                                   f"the parameter group of module {name or 'root'!r}; its "
                                   "shards cannot be offloaded with this torch version")
            out.append(Group(name, group, params))
    return out


class Shard:
    """Where one FSDP2 shard's value shows (an :class:`~._entry.Home`): FSDP's padded flat
    tensor and its DTensor's local tensor, and ``local``, the plain parameter the optimizer
    updates (the unpadded shard, a view of the same memory)."""

    def __init__(self, fsdp_param: Any) -> None:
        self.fsdp_param = fsdp_param
        sharded = fsdp_param.sharded_param
        self.dtensor: torch.nn.Parameter = sharded
        local = sharded._local_tensor
        if local.is_meta or local.device.type != "cpu":
            raise ValueError(f"offload_parameters needs CPU shards; a shard of shape "
                             f"{list(sharded.shape)} is on {local.device}")
        self.shape = torch.Size(fsdp_param.padded_sharded_param_size)
        self.dim = _shard_dim(fsdp_param)
        self.length = local.size(self.dim) if local.dim() else 0
        self.local = torch.nn.Parameter(placeholder(local.shape, local.dtype),
                                        requires_grad=sharded.requires_grad)

    def value(self) -> torch.Tensor:
        """FSDP's padded shard as it is now (what the entry stores)."""
        return self.fsdp_param._sharded_param_data.view(self.shape)  # type: ignore[no-any-return]

    def _local_view(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, 0, self.length) if tensor.dim() else tensor

    @torch.no_grad()
    def show(self, tensor: torch.Tensor) -> None:
        local = self._local_view(tensor)
        self._point(tensor.untyped_storage(), int(tensor.storage_offset()), local, 1)
        self.local.data = local

    @torch.no_grad()
    def hide(self) -> None:
        ph = placeholder(self.shape, self.local.dtype)
        local = self._local_view(ph)
        self._point(ph.untyped_storage(), int(ph.storage_offset()), local, 0)
        self.local.data = local

    def _point(self, storage: torch.UntypedStorage, offset: int, local: torch.Tensor,
               stride: int) -> None:
        fp = self.fsdp_param
        fp._sharded_param_data.set_(storage, offset, (self.shape.numel(),), (stride,))
        dtensor_local: torch.Tensor = self.dtensor._local_tensor  # type: ignore[attr-defined]
        dtensor_local.set_(storage, local.storage_offset(), local.size(), local.stride())


def _shard_dim(fsdp_param: Any) -> int:
    placement = getattr(fsdp_param, "fsdp_placement", None)
    return int(getattr(placement, "dim", 0))


def wrap_unshard(group: Any, before: Callable[[], None], after: Callable[[], None]) -> Callable[[], None]:
    """Make ``group.unshard`` call ``before()`` ahead of an all-gather that reads the shards
    (not when it is a no-op: already gathered or pending) and ``after()`` once it returned
    (the shards were copied into the all-gather's buffer). Returns the undo."""
    original = group.unshard

    def unshard(async_op: bool = False) -> Any:
        if group._all_gather_result is not None or not group.is_sharded:
            return original(async_op)
        before()
        try:
            return original(async_op)
        finally:
            after()

    group.unshard = unshard

    def undo() -> None:
        if group.__dict__.get("unshard") is unshard:
            del group.unshard
    return undo


def shard_model(model: torch.nn.Module) -> bool:
    """Apply ``fully_shard`` as ZeRO stage 3 partitions a model across the ranks of the default
    process group: each item with parameters of a ``ModuleList`` or ``Sequential`` (the
    outermost such items: transformer blocks, layers) becomes a group, and the root takes the
    rest. Returns False (and changes nothing) without an initialized process group of more
    than one rank, or if ``model`` is sharded already."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return False
    if is_sharded_model(model):
        return False
    from torch.distributed.fsdp import fully_shard
    chosen: list[tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        for child_name, child in module.named_children():
            path = f"{name}.{child_name}" if name else child_name
            inside = any(path.startswith(c + ".") for c, _ in chosen)
            if not inside and next(child.parameters(), None) is not None:
                chosen.append((path, child))
    for _, child in chosen:
        fully_shard(child)
    fully_shard(model)
    return True
