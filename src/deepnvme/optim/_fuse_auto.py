"""``fuse_backward="auto"``: learn from the first step whether the update may go into the backward,
and mark gradients the fused update consumed so that using one later fails loudly.

The fused update (:mod:`._fused`) is wrong for a loop that accumulates gradients (several backward
passes per step), or that reads or changes them between ``backward()`` and ``step()`` (gradient
clipping, unscaling, a DDP all-reduce after the hooks ran). ``"auto"`` runs the first step unfused
while :class:`StepObserver` watches every parameter: how many gradients it got before ``step()``
and, for a gradient in memory, whether that tensor was replaced or changed in place afterwards
(its version counter), whether the param groups' options (``lr``, ...) changed after the
first gradient, and whether a module ran its forward with a parameter that had its
gradient already (an evaluation between ``backward()`` and ``step()`` must see the parameters
from before the update). Only a clean step (one gradient each, none touched, no such forward,
one process, or ranks whose every parameter is an offloaded FSDP2 shard: FSDP2 runs the hooks
after its reduce-scatter) turns fusing on from the next step. Once fused, :func:`forward_guard` refuses a
forward with a parameter that was updated before ``step()``. After that, a fused parameter's ``.grad`` holds a
:class:`ConsumedGradient` until ``step()``: a tensor without storage whose every operation
raises an error naming the fix, so a later clip, norm or accumulation cannot silently see
nothing.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ._protocol import offload_of

__all__ = [
    "ConsumedGradient",
    "StepObserver",
    "clear_consumed",
    "forward_guard",
    "mark_consumed",
    "multi_rank",
    "options_of",
]

Options = list[list[tuple[str, Any]]]


def options_of(groups: Sequence[dict[str, Any]]) -> Options:
    """The param groups' options (not their parameters), comparable with ``==``: a tensor
    option (a tensor ``lr``) by identity and version counter."""

    def key(v: Any) -> Any:
        return ("tensor", id(v), v._version) if isinstance(v, torch.Tensor) else v

    return [sorted(((k, key(v)) for k, v in g.items() if k != "params"), key=lambda kv: kv[0]) for g in groups]


_FIX = (
    "between backward() and step() a gradient fused into the backward can be neither read, "
    "clipped, scaled nor accumulated (a second backward); create the NVMeOptimizer with "
    "fuse_backward=False for such a loop"
)


class ConsumedGradient(torch.Tensor):
    """Stands in ``param.grad`` for a gradient that the fused update used already: shape, dtype
    and device of the parameter, no storage; any operation on it raises ``RuntimeError``."""

    shape_of: list[int]

    @staticmethod
    def __new__(cls, like: torch.Tensor) -> ConsumedGradient:
        t = torch.Tensor._make_wrapper_subclass(
            cls, like.shape, dtype=like.dtype, device=like.device, requires_grad=False
        )
        t.shape_of = list(like.shape)
        return t

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls,
        func: Any,
        types: Any,
        args: Any = (),
        kwargs: Any = None,
    ) -> Any:
        shapes = [a.shape_of for a in args if isinstance(a, ConsumedGradient)]
        if not shapes and args and isinstance(args[0], (list, tuple)):  # foreach ops
            shapes = [a.shape_of for a in args[0] if isinstance(a, ConsumedGradient)]
        raise RuntimeError(
            f"NVMeOptimizer updated a parameter of shape {shapes[0] if shapes else '?'} "
            f"in the backward pass and its gradient is gone ({func} was called on "
            f"it): {_FIX}"
        )

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"ConsumedGradient(shape={self.shape_of})"


def mark_consumed(p: torch.Tensor) -> None:
    """Set ``p.grad`` to a :class:`ConsumedGradient` (plain CPU parameters only; others: None)."""
    if type(p.data) is torch.Tensor:
        p.grad = ConsumedGradient(p)
    else:
        p.grad = None


def clear_consumed(params: Iterable[torch.Tensor]) -> None:
    """``step()`` ended: drop the stand-ins, so ``.grad`` reads None as after ``zero_grad``."""
    for p in params:
        if isinstance(p.grad, ConsumedGradient):
            p.grad = None


def multi_rank() -> bool:
    """Whether this process is one rank of several (gradients may be reduced after the hooks)."""
    dist = torch.distributed
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _uses(module: torch.nn.Module, ids: set[int] | dict[int, Any]) -> torch.Tensor | None:
    """A parameter of ``module`` itself (not its children) whose id is in ``ids``, or None."""
    for p in module._parameters.values():
        if p is not None and id(p) in ids:
            return p
    return None


def forward_guard(updated: set[int]) -> RemovableHandle:
    """A global forward pre-hook raising when a module runs with a parameter in ``updated``
    (updated in the backward, before ``step()``): its forward would see the new values."""

    def hook(module: torch.nn.Module, args: Any) -> None:
        p = _uses(module, updated) if updated else None
        if p is not None:
            raise RuntimeError(
                f"{type(module).__name__}.forward ran between backward() and step() with a "
                f"parameter of shape {list(p.shape)} that NVMeOptimizer already updated in the "
                "backward (it would see the new values: an evaluation, or the next micro-batch of "
                "gradient accumulation); run such forwards after step(), or create the "
                "NVMeOptimizer with fuse_backward=False"
            )

    return torch.nn.modules.module.register_module_forward_pre_hook(hook)


class StepObserver:
    """Hooks that watch one unfused step (see the module doc); :meth:`verdict` at ``step()``."""

    def __init__(
        self, params: Iterable[torch.Tensor], groups: Sequence[dict[str, Any]], *, reduced: bool = False
    ) -> None:
        self.groups = groups
        self.reduced = reduced  # every gradient reduced across ranks before the hooks (FSDP2)
        self.options: Options | None = None  # at the step's first gradient
        self.counts: dict[int, int] = {}
        self.seen: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}
        self.shapes: dict[int, list[int]] = {}
        self.params: list[torch.Tensor] = []
        self.hooks: list[RemovableHandle] = []
        self.late_forward: str | None = None
        self.hooks.append(torch.nn.modules.module.register_module_forward_pre_hook(self._forward))
        self.watch(params)

    def _forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.counts and self.late_forward is None and _uses(module, self.counts) is not None:
            self.late_forward = type(module).__name__

    def watch(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            if p.requires_grad:
                self.params.append(p)
                self.hooks.append(p.register_post_accumulate_grad_hook(self._hook))

    def _hook(self, p: torch.Tensor) -> None:
        key = id(p)
        if not self.counts:
            self.options = options_of(self.groups)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.shapes[key] = list(p.shape)
        grad = p.grad
        if grad is not None and offload_of(p) is None:  # an offload takes its gradients away
            self.seen[key] = (weakref.ref(grad), grad._version)

    def verdict(self) -> str | None:
        """At ``step()``: None if the step was clean (fusing is safe), else the reason; "" when
        no gradient arrived at all (nothing learned yet: observe the next step)."""
        if not self.counts:
            return ""
        if multi_rank() and not self.reduced:
            return "a multi-rank job (gradients are reduced after the backward hooks)"
        for key, n in self.counts.items():
            if n > 1:
                return (
                    f"a parameter of shape {self.shapes[key]} got {n} gradients before step() (gradient accumulation)"
                )
        if self.late_forward is not None:
            return (
                f"{self.late_forward}.forward ran between backward() and step() (an "
                "evaluation or a further micro-batch: it must see the parameters as before "
                "the update)"
            )
        if options_of(self.groups) != self.options:
            return (
                "the optimizer's options (lr, ...) changed between backward() and step() "
                "(a fused update would have used the old ones)"
            )
        by_id = {id(p): p for p in self.params}
        for key, (ref, version) in self.seen.items():
            grad = by_id[key].grad
            if grad is None or ref() is not grad or grad._version != version:
                return (
                    f"the gradient of a parameter of shape {self.shapes[key]} was changed "
                    "between backward() and step() (clipping, scaling or a reduction)"
                )
        return None

    def reset(self) -> None:
        self.counts.clear()
        self.seen.clear()
        self.late_forward = None

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.params.clear()
        self.reset()
