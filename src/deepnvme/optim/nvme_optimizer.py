"""``NVMeOptimizer``: any torch optimizer with its state on NVMe between steps.

The wrapped optimizer does the maths: ``step()`` walks sub-groups of parameters, installs each
sub-group's state (views into a pinned buffer just read from its swap file), narrows the
param groups to that sub-group's parameters and calls the wrapped optimizer's own ``step()``,
then writes the state back. Reads of sub-group i+1 and writes of i-1 run on the engine's
threads while i is updated, so results are bitwise those of the wrapped optimizer in memory.
Sub-groups are planned by :mod:`._subgroups`, their state moved by :mod:`._state`; a parameter
larger than a sub-group is updated in slices by an element-wise optimizer (:mod:`._slices`);
parameters held by a parameter offload are updated through it (:mod:`._protocol`).

Memory bound: ``buffer_count`` pinned buffers of one sub-group's state (plus, on the first step
or after a state layout change, one sub-group's freshly created state). Small per-parameter
values (0-d tensors such as Adam's ``step``, numbers, None) stay in ``optimizer.state``.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..config import IOConfig
from ..errors import OffloadMemoryError
from ..handles.aio import AioHandle
from ..io.volume import Volume
from ..memory.heap import trim_heap
from ..swap import TensorSwapper
from ._checks import check_arguments, check_cpu, raise_failed_writes
from ._fuse_auto import StepObserver, multi_rank
from ._fused import FusedBackward
from ._protocol import OffloadedParameters, find_offload, offload_of
from ._sharded import gradient_sources, local_parameters
from ._slices import Slices, is_elementwise
from ._state import StateSwap, Writes
from ._subgroups import Member, SubGroups
from ._updating import Updating

__all__ = ["NVMeOptimizer"]

log = logging.getLogger(__name__)

_HOOK_DICTS = (
    "_optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks",
    "_optimizer_state_dict_pre_hooks",
    "_optimizer_state_dict_post_hooks",
    "_optimizer_load_state_dict_pre_hooks",
    "_optimizer_load_state_dict_post_hooks",
)


class NVMeOptimizer(Updating, torch.optim.Optimizer):
    """Drop-in optimizer whose state lives in files under ``swap_dir`` between steps.

    ``optimizer_cls(params, **optimizer_kwargs)`` is built and does every update, so param
    groups, ``zero_grad``, lr schedulers and ``state_dict``/``load_state_dict`` behave as with
    it. ``step()`` blocks until every write finished. Not thread-safe (like torch's
    optimizers). Step pre/post hooks registered here run once per step; other hooks belong on
    :attr:`optimizer`. Parameters held by :func:`~deepnvme.offload_parameters` are read in and
    written back through their offload, sub-group by sub-group.

    Args:
        params: the parameters to optimize, or param group dicts, as for any torch optimizer
            (``model.parameters()``; not a model, not an optimizer instance). CPU tensors.
        optimizer_cls: the torch optimizer class that does the updates (default
            ``torch.optim.AdamW``); a class, not an instance.
        swap_dir: the directory under which a private subdirectory holds the state files
            (created if missing; removed by :meth:`close`, with ``swap_dir`` itself if this
            optimizer created it and nothing else is in it).
        sub_group_bytes: parameter bytes per sub-group, the unit read, updated and written
            together (DeepSpeed's ``sub_group_size``, in bytes). Its state on disk is that times
            the optimizer's state per parameter byte (2 for Adam/AdamW, 1 for SGD with
            momentum). A larger parameter is updated in contiguous slices of at most this size
            (page multiples) by an element-wise optimizer (SGD, Adam, AdamW, or a class with
            ``deepnvme_elementwise = True``), bitwise as whole, so memory stays bounded by the
            sub-group, not the largest parameter; for any other optimizer it forms its own
            sub-group. Lowered to fit a parameter offload's budget.
        buffer_count: pinned buffers of one sub-group's state (>= 2; 3 overlaps read, update
            and write).
        config: I/O settings for the handle created for the swap files (unused with ``handle``).
        stale: what to do with swap directories of crashed runs in ``swap_dir``: ``"warn"``,
            ``"remove"`` or ``"error"``.
        handle: an :class:`~deepnvme.AioHandle` to do the I/O with instead of a new one.
        update_threads: torch's intra-op threads (``torch.set_num_threads``, process-wide) for
            each sub-group's update, restored after it; None keeps the caller's. The update
            runs while the next sub-group is read and the previous one written, and where the
            I/O threads need the cores that torch's threads use, fewer threads finish sooner.
            Element-wise optimizers (SGD, Adam, AdamW) give bitwise the
            same results with any thread count; one that reduces (a norm) may round
            differently. ``"auto"``: for element-wise optimizers (``torch.optim.SGD``, ``Adam``
            and ``AdamW`` themselves, or a declared class), torch's threads less the I/O
            handle's threads (at least 1); for any other optimizer, None.
        fuse_backward: update each sub-group inside the backward pass, as soon as all its
            parameters have their gradients (post-accumulate-grad hooks; an offloaded
            gradient is then never written and read back); ``step()`` finishes the step.
            Wrong for loops that accumulate gradients or read or change them between
            ``backward()`` and ``step()`` (clipping, scaling): with it on, a used gradient's
            ``.grad`` raises on any use until ``step()``, and a second backward raises.
            ``"auto"`` (default): the first step that has gradients runs unfused and is
            watched; fusing starts from the next step only if each parameter got one gradient
            that nothing changed before ``step()`` and no forward used before ``step()``, in a
            single-process job, or one whose every parameter is an offloaded FSDP2 shard (FSDP2
            reduces a gradient before its hooks), on the CPU (else never, logged once). True:
            fused from the first step; False: never. A ``step()`` with no gradient from the backward since
            the last one (gradients set by hand) runs unfused.
        **optimizer_kwargs: the options of ``optimizer_cls`` (``lr``, ``betas``, ...).

    Raises:
        TypeError: ``params`` is an optimizer or a module, or ``optimizer_cls`` is not a class.
        ValueError: a bad ``buffer_count`` or ``update_threads``, or a parameter not on the CPU.
    """

    def __init__(
        self,
        params: Iterable[Any],
        optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
        *,
        swap_dir: str | os.PathLike[str] | Volume,
        sub_group_bytes: int = 256 << 20,
        buffer_count: int = 3,
        config: IOConfig | None = None,
        stale: str = "warn",
        handle: AioHandle | None = None,
        update_threads: int | str | None = "auto",
        fuse_backward: bool | str = "auto",
        **optimizer_kwargs: Any,
    ) -> None:
        check_arguments(params, optimizer_cls)
        if update_threads not in ("auto", None) and (
            isinstance(update_threads, bool) or not isinstance(update_threads, int) or update_threads < 1
        ):
            raise ValueError(f"update_threads must be an int >= 1, 'auto' or None, got {update_threads!r}")
        if fuse_backward not in (True, False, "auto"):
            raise ValueError(f"fuse_backward must be True, False or 'auto', got {fuse_backward!r}")
        if buffer_count < 2:
            raise ValueError(f"buffer_count must be >= 2 (3 overlaps read, update and write), got {buffer_count}")
        self.optimizer = optimizer_cls(local_parameters(params), **optimizer_kwargs)
        check_cpu(self._all_params())
        for name in _HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()
        self.sub_group_bytes = int(sub_group_bytes)
        self._offload: OffloadedParameters | None = None
        self._whole_io: set[int] = set()
        self._open_whole: torch.Tensor | None = None
        self._join_offload(self._all_params())
        self._subs = SubGroups(self.optimizer)
        bounds = self._subs.add(self._all_params(), self.sub_group_bytes, self._sliceable)
        swapper = TensorSwapper(
            swap_dir,
            config=config,
            buffer_bytes=max(bounds + [1]),
            buffer_count=buffer_count,
            min_swap_bytes=0,
            stale=stale,
            handle=handle,
        )
        self._state = StateSwap(self.optimizer, self._subs, swapper)
        self._slices = Slices(self.optimizer, self._subs, self._state)
        self.update_threads = update_threads if isinstance(update_threads, int) else None
        if update_threads == "auto" and is_elementwise(type(self.optimizer)):
            io_threads = swapper.io_config.intra_op_parallelism
            self.update_threads = max(1, torch.get_num_threads() - io_threads)
        self._current, self._done = None, -1
        fusable = self._offload is None or getattr(self._offload, "fused_gradients", False)
        if fuse_backward is True and not fusable:
            raise ValueError(
                f"fuse_backward=True: the parameter offload "
                f"({type(self._offload).__name__}) does not hand its gradients to the "
                "optimizer in the backward (a model on a device); use "
                "fuse_backward=False or 'auto'"
            )
        self._fused = FusedBackward(self) if fuse_backward is True else None
        self._observer: StepObserver | None = None
        sources, reduced = gradient_sources(p for _, p in self._all_params())
        if fuse_backward == "auto" and fusable and (reduced or not multi_rank()):
            self._observer = StepObserver(sources, self.optimizer.param_groups, reduced=reduced)

    # --- the torch.optim.Optimizer surface -------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's state: between steps it holds only the small values."""
        return self.optimizer.state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @property
    def swap_directory(self) -> str:
        """The private directory holding this optimizer's swap files."""
        return self._state.swapper.directory

    @property
    def num_sub_groups(self) -> int:
        return len(self._subs)

    @property
    def num_sliced_params(self) -> int:
        """Parameters updated in slices (larger than a sub-group, element-wise optimizer)."""
        return len(self._slices.by_param())

    @property
    def swapped_bytes(self) -> int:
        """Bytes of optimizer state in the swap files now (packed, with alignment padding)."""
        return sum(layout.total for layout in self._subs.layouts if layout is not None)

    @property
    def buffer_bytes(self) -> int:
        """Bytes of each of the ``buffer_count`` pinned buffers of one sub-group's state."""
        return self._state.swapper.buffer_bytes

    @property
    def fuses_backward(self) -> bool:
        """Whether the update runs inside the backward now (see ``fuse_backward``)."""
        return self._fused is not None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the wrapped optimizer's gradients, and those of offloaded parameters.

        Raises:
            RuntimeError: the update is fused and some parameters were updated in the backward
                since the last ``step()`` (discarding their gradients cannot undo that).
        """
        if self._fused is not None:
            self._fused.clear()
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self._offload is not None:
            self._offload.zero_grad()

    def _join_offload(self, params: list[Member]) -> None:
        """Find the parameter offload holding any of ``params`` (one per optimizer), fit the
        sub-groups to its budget, and check that each parameter not updated in slices can be
        updated whole within it."""
        found = find_offload(p for _, p in self._all_params())
        if found is None:
            return
        if self.sub_group_bytes > found.update_bytes():
            self.sub_group_bytes = found.update_bytes()
            log.info(
                "NVMeOptimizer: sub_group_bytes lowered to %d to fit the parameter offload's budget",
                self.sub_group_bytes,
            )
        self._offload = found
        found.check_updatable(p for _, p in params if not self._sliceable(p) or id(p) in self._whole_io)

    def _sliceable(self, p: torch.Tensor) -> bool:
        """Whether ``p`` is updated in slices: an element-wise optimizer, and a parameter larger
        than a sub-group whose elements are contiguous (an offloaded one always is, in its
        file). An offloaded one whose whole update fits the offload's budget is read in and
        written back whole (its state still goes slice by slice): noted in ``_whole_io``."""
        if not (
            is_elementwise(type(self.optimizer))
            and p.numel() > 0
            and p.numel() * p.element_size() > self.sub_group_bytes
        ):
            return False
        offload = self._offload if offload_of(p) is not None else None
        if offload is None:
            return p.is_contiguous()
        try:
            offload.check_updatable([p])
        except OffloadMemoryError:
            self._whole_io.discard(id(p))
            return True
        self._whole_io.add(id(p))
        return True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its parameters form new sub-groups (offloaded
        parameters among them are updated through their offload, as at construction)."""
        known = {id(p) for sub in self._subs.members for _, p in sub}
        n_groups, n_subs = len(self.optimizer.param_groups), len(self._subs)
        offload, sub_group_bytes = self._offload, self.sub_group_bytes
        self.optimizer.add_param_group(local_parameters([param_group])[0])
        try:
            fresh = [(gi, p) for gi, p in self._all_params() if id(p) not in known]
            check_cpu(fresh)
            self._join_offload(fresh)
            bounds = self._subs.add(fresh, self.sub_group_bytes, self._sliceable)
            swapper = self._state.swapper
            if max(bounds + [0]) > swapper.buffer_bytes:
                raise ValueError(
                    f"the new group's sub-groups need {max(bounds)} bytes of state but "
                    f"the swap buffers hold {swapper.buffer_bytes}; create the "
                    "NVMeOptimizer with all groups, or with a larger parameter first"
                )
        except BaseException:  # leave the optimizer as it was: the group is not added
            self._offload, self.sub_group_bytes = offload, sub_group_bytes
            del self.optimizer.param_groups[n_groups:]
            self._subs.truncate(n_subs, n_groups)
            raise
        if self._fused is not None:
            self._fused.attach()
        if self._observer is not None:
            sources, reduced = gradient_sources(p for _, p in fresh)
            self._observer.reduced = self._observer.reduced and reduced
            self._observer.watch(sources)

    def _decide_fusing(self) -> bool:
        """``fuse_backward="auto"``, at ``step()``: whether fusing starts after this step."""
        observer = self._observer
        if observer is None:
            return False
        reason = observer.verdict()
        if reason == "":
            return False  # no gradient yet: watch the next step
        observer.remove()
        self._observer = None
        if reason is not None:
            log.info("NVMeOptimizer: the update stays after the backward (fuse_backward='auto'): %s", reason)
            return False
        return True

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step over every sub-group (state read, updated, written back).

        On an I/O error the step stops: the sub-groups named in the error were updated, the
        rest were not, and no state is lost (what could not be written stays in memory).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._fused is not None and self._fused.active():
            self._fused.finish()
            return loss
        fuse_next = self._decide_fusing()
        writes: Writes = []
        self._current, self._done = None, -1
        state = self._state
        try:
            n = len(self._subs)
            state.prefetch(0)
            for i in range(n):
                raise_failed_writes(writes)
                if i + 1 < n:
                    state.prefetch(i + 1)
                fresh = self._subs.layouts[i] is None  # the wrapped optimizer creates its state
                fut = self._run_sub_group(i, lambda i=i: self._update(i))  # type: ignore[misc]
                if fresh and self._offload is not None:
                    trim_heap()  # the created state left the heap: give it back now
                if fut is not None:
                    writes.append((i, fut))
        except BaseException as exc:
            raise self._stopped(exc, writes) from exc
        failed = state.settle(writes, installed=None)
        if self._offload is not None:
            try:
                self._offload.finish_updates()
            except OSError as exc:  # a slice of a parameter could not be written
                failed = failed or exc
        if failed is not None:
            raise self._step_error(failed, self._done) from failed
        if fuse_next:
            self._fused = FusedBackward(self)
            log.info(
                "NVMeOptimizer: the update is fused into the backward from the next step "
                "(fuse_backward='auto': one gradient per parameter, unchanged before step())"
            )
        elif self._observer is not None:
            self._observer.reset()
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, with every sub-group's state read back into new
        CPU tensors (so it needs memory for the whole state; it does not change the files)."""
        try:
            self._state.read_back()
            self._slices.assemble()
            return self.optimizer.state_dict()
        finally:
            self._state.drop(range(len(self._subs)), fresh_dicts=True)
            self._slices.strip()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer, then write the state of every sub-group to NVMe."""
        self.optimizer.load_state_dict(state_dict)
        self._subs.layouts = [None] * len(self._subs)
        writes: Writes = []
        for i in range(len(self._subs)):
            fut = self._state.store(i) if self._subs.spans[i] is None else None
            if fut is not None:
                writes.append((i, fut))
        writes += self._slices.split_loaded()
        failed = self._state.settle(writes, installed=None)
        if failed is not None:
            raise failed

    def close(self) -> None:
        """Delete the swap files (the state is lost unless saved) and the private directory
        holding them, and ``swap_dir`` if this optimizer created it and it is empty. Idempotent."""
        if self._fused is not None:
            self._fused.detach()
        if self._observer is not None:
            self._observer.remove()
            self._observer = None
        self._state.swapper.close()

    def __enter__(self) -> NVMeOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"NVMeOptimizer({type(self.optimizer).__name__}, sub_groups={len(self._subs)}, "
            f"swap_dir={self.swap_directory!r})"
        )
