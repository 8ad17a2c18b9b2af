"""The optimizer update fused into the backward pass (``NVMeOptimizer(fuse_backward=True)``).

Each sub-group is updated as soon as every parameter of it has its gradient (autograd's
post-accumulate-grad hook, or the parameter offload handing the gradient over instead of
storing it): an offloaded gradient is then never written and read back, and an offloaded
parameter is updated while the backward has it in memory. ``step()`` updates the sub-groups
still waiting (a member that got no gradient) and waits for the writes.

Refused, loudly: a used gradient's ``.grad`` holds a :class:`~._fuse_auto.ConsumedGradient`
until ``step()``, so clipping or reading it, or a second backward before ``step()`` (gradient
accumulation), raises instead of seeing nothing; so does ``zero_grad()`` once a sub-group was
updated, and a gradient found on a parameter at ``step()`` that did not come through the
hooks, options of the param groups (``lr``) changed after the first fused update of a step,
and a module's forward with a parameter already updated before ``step()``
(:func:`~._fuse_auto.forward_guard`). Use ``fuse_backward=False`` for such loops.
Memory: the gradients of the sub-groups not yet complete (at most about one sub-group in the
usual reverse order), beside the optimizer's buffers and the offload's budget.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch
from torch.utils.hooks import RemovableHandle

from ._ahead import ReadsAhead
from ._fuse_auto import ConsumedGradient, Options, clear_consumed, forward_guard, mark_consumed, options_of
from ._protocol import offload_of
from ._state import Writes
from ._updating import Updating

__all__ = ["FusedBackward"]


class FusedBackward:
    """The hooks and the pending gradients of one NVMeOptimizer (see the module doc)."""

    def __init__(self, opt: Updating) -> None:
        self.opt = opt
        self.pending: dict[int, torch.Tensor] = {}   # id(param) -> its gradient, until used
        self.updated: set[int] = set()                # id(param): updated since step()
        self.writes: Writes = []
        self.reads = ReadsAhead(opt._state, self._kept, self._writing)
        self.hooks: list[RemovableHandle] = []
        self.subs_of: dict[int, list[int]] = {}
        self.consumed: list[torch.Tensor] = []        # parameters whose .grad is a stand-in
        self.options: Options | None = None           # at this step's first fused gradient
        self.attach()

    def attach(self) -> None:
        """Hook every parameter (again, after a param group was added)."""
        self.detach()
        opt = self.opt
        for i, members in enumerate(opt._subs.members):
            for _, p in members:
                self.subs_of.setdefault(id(p), []).append(i)
        if opt._offload is not None:
            opt._offload.set_gradient_consumer(self.take)
            opt._offload.set_update_notice(self.coming)
        self.hooks.append(forward_guard(self.updated))
        for _, p in opt._all_params():
            if p.requires_grad and offload_of(p) is None:
                self.hooks.append(p.register_post_accumulate_grad_hook(self._hook))

    def active(self) -> bool:
        """Whether a gradient came through the hooks since the last ``step()``."""
        return bool(self.pending or self.updated)

    def detach(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()
        self.subs_of.clear()
        if self.opt._offload is not None:
            self.opt._offload.set_gradient_consumer(None)
            self.opt._offload.set_update_notice(None)

    def _hook(self, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is not None:
            p.grad = None
            self.take(p, grad)

    def take(self, p: torch.Tensor, grad: torch.Tensor) -> bool:
        """Keep ``grad`` for ``p``; update its sub-group(s) once complete. False: not ours."""
        key = id(p)
        subs = self.subs_of.get(key)
        if subs is None:
            return False
        if key in self.pending or key in self.updated:
            raise RuntimeError(
                "NVMeOptimizer with the update fused into the backward got a second gradient "
                f"for a parameter of shape {list(p.shape)} before step(): gradients cannot be "
                "accumulated (nor clipped); call step() after each backward, or create the "
                "NVMeOptimizer with fuse_backward=False")
        if not self.active():
            self.options = options_of(self.opt.optimizer.param_groups)
        self.pending[key] = grad
        self._consume(p)
        members = self.opt._subs.members[subs[0]]
        if all(id(q) in self.pending for _, q in members if q.requires_grad):
            self.update(subs)
        return True

    def update(self, subs: list[int]) -> None:
        """Update sub-groups ``subs`` (one whole sub-group, or every slice of one parameter)
        with the pending gradients; offloaded parameters are fetched whole and written back."""
        opt = self.opt
        params = opt._subs.params(subs[0])
        grads = {id(q): self.pending.pop(id(q)) for q in params if id(q) in self.pending}
        held = [q for q in params if offload_of(q) is not None]
        offload = opt._offload if held else None
        if offload is not None:
            offload.begin_update(held)   # gradients consumed: only the parameters are read
        opt._current, opt._done = None, -1
        try:
            for k, i in enumerate(subs):
                read_ahead = self.reads.installing(i)
                if k + 1 < len(subs):   # the next slice's read must leave i's install a buffer
                    self.reads.start(subs[k + 1], wait=True, reserve=0 if read_ahead else 1)
                fut = opt._run_sub_group(i, lambda i=i: self._apply(i, grads))  # type: ignore[misc]
                if fut is not None:
                    self.writes.append((i, fut))
            self.reads.updated(subs)
        except BaseException as exc:
            for q in params:
                q.grad = None
            if offload is not None:
                offload.abort_update(held)
            self.reads.end_step(completed=False)
            writes, self.writes = self.writes, []
            raise opt._stopped(exc, writes) from exc
        for q in params:
            q.grad = None
        if offload is not None:
            offload.end_update(held)
        for q in params:
            if id(q) in grads:
                self._consume(q)
        self.updated.update(grads)

    def _consume(self, p: torch.Tensor) -> None:
        mark_consumed(p)
        self.consumed.append(p)

    def clear(self) -> None:
        """``zero_grad()``: forget the pending gradients; refused once a sub-group was updated
        in this backward (the update cannot be undone)."""
        if self.updated:
            raise RuntimeError(
                "NVMeOptimizer.zero_grad() after a backward whose update was fused into it: "
                f"{len(self.updated)} parameters were already updated and cannot be restored; "
                "call step() after each backward, or create the NVMeOptimizer with "
                "fuse_backward=False to discard gradients")
        self.pending.clear()
        clear_consumed(self.consumed)
        self.consumed.clear()

    def _check_unexpected(self) -> None:
        """A gradient on an in-memory parameter at ``step()`` that the hooks did not take (set
        by hand, or produced with the hooks off) would be skipped: raise instead."""
        for _, p in self.opt._all_params():
            g = p.grad
            if g is not None and offload_of(p) is None and id(p) not in self.pending \
                    and id(p) not in self.updated and not isinstance(g, ConsumedGradient):
                raise RuntimeError(
                    f"NVMeOptimizer.step() found a gradient on a parameter of shape "
                    f"{list(p.shape)} that did not come through the backward's hooks (the "
                    "update is fused into the backward, so it would be skipped); assign no "
                    ".grad by hand, or create the NVMeOptimizer with fuse_backward=False")

    def coming(self, params: list[torch.Tensor]) -> None:
        """The offload's notice: the gradients of ``params`` come soon (their FSDP2 group was
        all-gathered for the backward), so their state is read during the group's backward
        rather than when the update waits for it (see :mod:`._ahead`); never blocks."""
        for p in params:
            subs = self.subs_of.get(id(p))
            if subs is not None:
                self.reads.notice(subs[0])

    def _writing(self) -> list[Future[None]]:
        """This step's writes still in flight."""
        return [f for _, f in self.writes if not f.done()]

    def _kept(self) -> int:
        """Pool buffers kept by this step's failed writes (each the only good copy)."""
        return sum(1 for _, f in self.writes if f.done() and f.exception() is not None)

    def _apply(self, i: int, grads: dict[int, torch.Tensor]) -> None:
        opt = self.opt
        span = opt._subs.spans[i]
        if span is None:
            for q in opt._subs.params(i):
                q.grad = grads.get(id(q))
            opt._wrapped_step()
            return
        p = opt._subs.params(i)[0]
        grad = grads.get(id(p))
        opt._slices.bind(i, p.data.view(-1)[span[0]:span[1]],
                         None if grad is None else grad.reshape(-1)[span[0]:span[1]])
        try:
            opt._wrapped_step()
        finally:
            opt._slices.unbind(i)

    def finish(self) -> None:
        """``step()``: update the sub-groups still waiting, wait for every write, and start
        the next step's bookkeeping."""
        opt = self.opt
        self._check_unexpected()
        if options_of(opt.optimizer.param_groups) != self.options:
            raise RuntimeError(
                "NVMeOptimizer.step(): the optimizer's options (lr, ...) changed between "
                "backward() and step(), after the update fused into the backward used the old "
                "ones; change them before the forward, or create the NVMeOptimizer with "
                "fuse_backward=False")
        waiting = sorted({self.subs_of[k][0] for k in self.pending}, reverse=True)
        for first in waiting:
            self.update(self.subs_of[id(opt._subs.params(first)[0])])
        self.reads.end_step(completed=True)   # settle below releases the buffers
        writes, self.writes = self.writes, []
        self.updated.clear()
        clear_consumed(self.consumed)
        self.consumed.clear()
        failed = opt._state.settle(writes, installed=None)
        if opt._offload is not None:
            try:
                opt._offload.finish_updates()
            except OSError as exc:
                failed = failed or exc
        if failed is not None:
            raise opt._step_error(failed, len(opt._subs) - 1) from failed
