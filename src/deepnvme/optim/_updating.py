"""How NVMeOptimizer runs one sub-group's update: its state installed, the param groups
narrowed to it, the wrapped optimizer's own ``step()``, the state stored; offloaded parameters
(whole, or a slice at a time) read in and written back around the update.
Mixed into :class:`~deepnvme.optim.NVMeOptimizer`, which sets the attributes declared here.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Callable
from concurrent.futures import Future

import torch

from ..swap import SwapBufferError, SwapError
from ._protocol import OffloadedParameters, offload_of
from ._slices import Slices
from ._state import StateSwap, Writes
from ._subgroups import Member, SubGroups

__all__ = ["Updating"]

log = logging.getLogger("deepnvme.optim.nvme_optimizer")


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
    _whole_io: set[int]    # id of offloaded parameters updated in slices but read in whole
    _open_whole: torch.Tensor | None   # such a parameter held between its slices now

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
        if id(p) in self._whole_io:
            self._update_slice_of_whole(i, span, p, offload)
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

    def _update_slice_of_whole(self, i: int, span: tuple[int, int], p: torch.Tensor,
                               offload: OffloadedParameters) -> None:
        """An offloaded parameter whose whole update fits the offload's budget: read in whole
        (with its gradient) for its first slice, written back after its last; only its state
        goes slice by slice."""
        if span[0] == 0:
            offload.begin_update([p])
            self._open_whole = p
        last = self._subs.is_last_slice(i)
        if last:
            self._prefetch_next(i)
        self._slices.bind(i, p.data.view(-1)[span[0]:span[1]],
                          None if p.grad is None else p.grad.view(-1)[span[0]:span[1]])
        try:   # no local reference to the gradient: its buffer is reused once it is let go
            self._wrapped_step()
        except BaseException:
            self._slices.unbind(i)
            self._abort_whole()
            raise
        self._slices.unbind(i)
        if last:
            self._open_whole = None
            offload.end_update([p])

    def _abort_whole(self) -> None:
        """A step stopped while a parameter updated slice by slice was held whole: let it go
        without writing it (its file keeps the values from before the step)."""
        p, self._open_whole = self._open_whole, None
        if p is not None and self._offload is not None:
            self._offload.abort_update([p])

    def _prefetch_next(self, i: int) -> None:
        """Have the offload read sub-group i+1's parameters (or slice) ahead."""
        offload = self._offload
        if offload is None or i + 1 >= len(self._subs):
            return
        span = self._subs.spans[i + 1]
        if span is None or id(self._slices.param(i + 1)) in self._whole_io:
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

    def _all_params(self) -> list[Member]:
        return [(gi, p) for gi, g in enumerate(self.optimizer.param_groups) for p in g["params"]]

    def _stopped(self, exc: BaseException, writes: Writes) -> BaseException:
        """After an update stopped: settle the writes (keeping what could not be written in
        memory) and return the error to raise."""
        self._abort_whole()
        failed = self._state.settle(writes, installed=self._current)
        self._current = None
        if self._offload is not None:
            try:
                self._offload.finish_updates()
            except OSError as late:   # the step's own error is the one to raise
                log.error("NVMeOptimizer: after the step stopped, a write failed too: %s", late)
        if failed is not None and isinstance(exc, SwapBufferError):
            exc = failed  # no buffer came free because a write failed: report the write
        return self._step_error(exc, self._done)

    def _step_error(self, exc: BaseException, done: int) -> BaseException:
        if not isinstance(exc, OSError):
            return exc
        n = len(self._subs)
        updated = f"sub-groups 0..{done} of {n} were updated" if done >= 0 else "no sub-group was updated"
        resident = [i for i, lay in enumerate(self._subs.layouts) if lay is None]
        return SwapError(f"NVMeOptimizer.step stopped: {exc}; {updated}; the state of sub-groups "
                         f"{resident} is kept in memory", path=getattr(exc, "path", None),
                         offset=getattr(exc, "offset", None), size=getattr(exc, "size", None),
                         errno=exc.errno or errno.EIO)
