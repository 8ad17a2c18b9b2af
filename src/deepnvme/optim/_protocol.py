"""What :class:`~deepnvme.NVMeOptimizer` needs from a parameter offload, and how it finds one.

An offload (:class:`~deepnvme.ParameterOffload`) keeps parameters and gradients in files; the
optimizer reads each sub-group's in for its update and hands them back after. The optimizer
knows the offload only through :class:`OffloadedParameters`: the offload marks each parameter
it holds with :func:`mark_offloaded`, and the optimizer looks the mark up with
:func:`find_offload`. Defined here, where it is consumed, so ``offload`` depends on ``optim``
and never the reverse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol, runtime_checkable

import torch

__all__ = ["OffloadedParameters", "find_offload", "mark_offloaded", "offload_of"]

_MARK = "_deepnvme_offload"   # the attribute an offload sets on each parameter it holds


@runtime_checkable
class OffloadedParameters(Protocol):
    """Parameters (and their gradients) held outside memory, updated sub-group by sub-group.

    Call order per optimizer step, for each sub-group in turn: :meth:`begin_update` (the
    parameters' ``.data`` and ``.grad`` are present), optionally :meth:`prefetch_update` for
    the next sub-group, the update, then :meth:`end_update` (or :meth:`abort_update` if the
    update raised); :meth:`finish_updates` once the step ended. A parameter larger than a
    sub-group, updated in slices (contiguous ranges of its flattened elements), goes through
    :meth:`prefetch_slice`, :meth:`begin_slice` and :meth:`end_slice` (or :meth:`abort_slice`)
    instead, slice by slice; only its slices are in memory, never the whole parameter.
    An offload whose every gradient reaches the consumer of :meth:`set_gradient_consumer` says
    so with a class attribute ``fused_gradients = True`` (``fuse_backward`` needs it).
    """

    def update_bytes(self) -> int:
        """The most parameter bytes one optimizer sub-group may have."""
        ...

    def check_updatable(self, params: Iterable[torch.Tensor]) -> None:
        """Raise now, naming the parameter, if one of ``params`` could not be updated."""
        ...

    def zero_grad(self) -> None:
        """Forget every gradient held for the parameters."""
        ...

    def prefetch_update(self, params: Iterable[torch.Tensor]) -> None:
        """Start reading ``params`` and their gradients ahead of their update."""
        ...

    def begin_update(self, params: Iterable[torch.Tensor]) -> None:
        """Bring ``params`` in, with their gradients as ``.grad``; blocks on the reads."""
        ...

    def end_update(self, params: Iterable[torch.Tensor]) -> None:
        """Keep the updated ``params`` (written back) and let them and their gradients go."""
        ...

    def abort_update(self, params: Iterable[torch.Tensor]) -> None:
        """The update of ``params`` failed: let them go with their values from before it."""
        ...

    def finish_updates(self) -> None:
        """The optimizer step ended (every sub-group was updated or the step stopped): let
        what was read ahead go, and raise the first failed write of a slice."""
        ...

    def set_gradient_consumer(self, consumer: Callable[[torch.Tensor, torch.Tensor], bool] | None
                              ) -> None:
        """Hand each gradient autograd produces to ``consumer(param, grad)`` first (an update
        fused into the backward); where it returns True the gradient is not stored. None: off."""
        ...

    def set_update_notice(self, notice: Callable[[list[torch.Tensor]], None] | None) -> None:
        """Call ``notice(params)`` when the gradients of ``params`` (parameters it holds) will
        come soon: an FSDP2 group all-gathered for the backward, its reduce-scatter next, so an
        update fused into the backward can start reading their optimizer state. None: off."""
        ...

    def prefetch_slice(self, param: torch.Tensor, start: int, stop: int) -> None:
        """Start reading elements ``start..stop`` of ``param`` and of its gradient."""
        ...

    def begin_slice(self, param: torch.Tensor, start: int,
                    stop: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Elements ``start..stop`` of ``param`` (flattened) and of its gradient (None if it has
        none), as 1-D tensors to update in place; blocks on the reads."""
        ...

    def end_slice(self, param: torch.Tensor, start: int, stop: int) -> None:
        """Write the updated slice back and let it and its gradient's slice go (drop every
        reference to them first: their buffers are reused)."""
        ...

    def abort_slice(self, param: torch.Tensor, start: int, stop: int) -> None:
        """The slice's update failed: let it go with its values from before it."""
        ...


def mark_offloaded(param: torch.nn.Parameter, offload: OffloadedParameters) -> None:
    """Record on ``param`` that ``offload`` holds it (the optimizer finds it there)."""
    setattr(param, _MARK, offload)


def offload_of(param: torch.Tensor) -> OffloadedParameters | None:
    """The offload that holds ``param``, or None."""
    found = getattr(param, _MARK, None)
    if found is None:
        return None
    if not isinstance(found, OffloadedParameters):
        raise TypeError(f"parameter attribute {_MARK} holds a {type(found).__name__}, not an "
                        "offload; it is set by offload_parameters only")
    return found


def find_offload(params: Iterable[torch.Tensor]) -> OffloadedParameters | None:
    """The one offload holding any of ``params``, or None; parameters of two offloads are
    refused (one optimizer updates through one offload)."""
    found: dict[int, OffloadedParameters] = {}
    for p in params:
        offload = offload_of(p)
        if offload is not None:
            found[id(offload)] = offload
    if len(found) > 1:
        raise ValueError("NVMeOptimizer got parameters of several offload_parameters calls; "
                         "offload the whole model once")
    return next(iter(found.values()), None)
