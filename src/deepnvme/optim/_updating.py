"""How NVMeOptimizer runs one sub-group's update: its state installed, the param groups
narrowed to it, the wrapped optimizer's own ``step()``, the state stored; offloaded parameters
(whole, or a slice at a time) read in and written back around the update.
Mixed into :class:`~deepnvme.optim.NVMeOptimizer`, which sets the attributes declared here.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

import torch

from ._protocol import OffloadedParameters, offload_of
from ._slices import Slices
from ._state import StateSwap
from ._subgroups import SubGroups

__all__ = ["Updating"]


class Updating:
    """One sub-group's update (see the module doc); not thread-safe."""

    optimizer: torch.optim.Optimizer
    update_threads: int | None
    _offload: OffloadedParameters | None
    _subs: SubGroups
    _state: StateSwap
    _slices: Slices
    _current: int | None   # the sub-group whose state is installed now
    _done: int             # the last sub-group updated in this step (-1: none)

    def _run_sub_group(self, i: int, update: Callable[[], None]) -> Future[None] | None:
        """Install sub-group ``i``'s state, run ``update`` with the param groups narrowed to
        its parameters (or its slice's stand-in), store the state; returns its write."""
        state = self._state
        self._slices.open(i)
        state.install(i)
        self._current = i
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = []
            for (gi, _), p in zip(self._subs.members[i], state.owners(i)):
                groups[gi]["params"].append(p)
            update()
        finally:
            for g, ps in zip(groups, saved):
                g["params"] = ps
        self._done = i
        fut = state.store(i)
        self._slices.close(i)
        self._current = None
        return fut

    def _update(self, i: int) -> None:
        """The wrapped optimizer's step on sub-group i (narrowed param groups), with offloaded
        parameters and gradients read in first and written back after (i+1's read ahead)."""
        span = self._subs.spans[i]
        if span is not None:
            self._update_slice(i, span)
            return
        offload = self._offload
        if offload is None:
            self._wrapped_step()
            return
        params = self._subs.params(i)
        offload.begin_update(params)
        self._prefetch_next(i)
        try:
            self._wrapped_step()
        except BaseException:
            offload.abort_update(params)
            raise
        offload.end_update(params)

    def _update_slice(self, i: int, span: tuple[int, int]) -> None:
        """Sub-group i is a slice of one parameter: its stand-in gets the slice of the
        parameter and of its gradient (from the offload, or views of the tensors in memory)."""
        p = self._slices.param(i)
        offload = self._offload if offload_of(p) is not None else None
        if offload is None:
            self._slices.bind(i, *self._slices.in_memory(i))
            try:
                self._wrapped_step()
            finally:
                self._slices.unbind(i)
            return
        self._slices.bind(i, *offload.begin_slice(p, *span))
        self._prefetch_next(i)
        try:
            self._wrapped_step()
        except BaseException:
            self._slices.unbind(i)
            offload.abort_slice(p, *span)
            raise
        self._slices.unbind(i)
        offload.end_slice(p, *span)

    def _prefetch_next(self, i: int) -> None:
        """Have the offload read sub-group i+1's parameters (or slice) ahead."""
        offload = self._offload
        if offload is None or i + 1 >= len(self._subs):
            return
        span = self._subs.spans[i + 1]
        if span is None:
            offload.prefetch_update(self._subs.params(i + 1))
        elif offload_of(self._slices.param(i + 1)) is not None:
            offload.prefetch_slice(self._slices.param(i + 1), *span)

    def _wrapped_step(self) -> None:
        """The wrapped optimizer's step, with ``update_threads`` torch threads if set."""
        threads = self.update_threads
        if threads is None:
            self.optimizer.step()
            return
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            self.optimizer.step()
        finally:
            torch.set_num_threads(before)
