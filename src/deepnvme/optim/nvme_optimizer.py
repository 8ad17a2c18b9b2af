"""``NVMeOptimizer``: any torch optimizer with its state on NVMe between steps.

The wrapped optimizer does the maths: ``step()`` walks sub-groups of parameters, installs each
sub-group's state (views into a pinned buffer just read from its swap file), narrows the
param groups to that sub-group's parameters and calls the wrapped optimizer's own ``step()``,
then writes the state back. Reads of sub-group i+1 and writes of i-1 run on the engine's
threads while i is updated, so results are bitwise those of the wrapped optimizer in memory.

Memory bound: ``buffer_count`` pinned buffers of one sub-group's state (plus, on the first step
or after a state layout change, one sub-group's freshly created state). Small per-parameter
values (0-d tensors such as Adam's ``step``, numbers, None) stay in ``optimizer.state``.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

import torch

from ..config import IOConfig
from ..handles.aio import AioHandle
from ..swap import SwapBufferError, SwapError, TensorSwapper
from ._layout import StateLayout, bound_bytes, partition, plan_layout

__all__ = ["NVMeOptimizer"]

_OFFLOAD_ATTRIBUTE = "_deepnvme_offload"  # set by deepnvme.offload on the parameters it holds

log = logging.getLogger(__name__)

_HOOK_DICTS = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
               "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
               "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")
# elementwise updates: bitwise the same with any number of threads (update_threads="auto")
_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def _swapped(value: Any) -> bool:
    """State values that go to NVMe: tensors with at least one dimension."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() > 0


def _find_offload(params: list[tuple[int, torch.Tensor]]) -> Any:
    """The :class:`~deepnvme.offload.ParameterOffload` holding these parameters, if any (it
    marks each parameter it holds); parameters of two offloads are refused."""
    found = {id(o): o for _, p in params if (o := getattr(p, _OFFLOAD_ATTRIBUTE, None)) is not None}
    if len(found) > 1:
        raise ValueError("NVMeOptimizer got parameters of several offload_parameters calls; "
                         "offload the whole model once")
    return next(iter(found.values()), None)


def _check_cpu(params: list[tuple[int, torch.Tensor]]) -> None:
    for gi, p in params:
        if p.device.type != "cpu":
            raise ValueError(f"NVMeOptimizer needs CPU parameters (with the master copy and the "
                             f"update on the CPU, as in ZeRO-Infinity's CPU optimizer); a "
                             f"parameter of group {gi} is on {p.device}")


class NVMeOptimizer(torch.optim.Optimizer):
    """Drop-in optimizer whose state lives in files under ``swap_dir`` between steps.

    ``optimizer_cls(params, **optimizer_kwargs)`` is built and does every update, so param
    groups, ``zero_grad``, lr schedulers and ``state_dict``/``load_state_dict`` behave as with
    it. ``sub_group_bytes`` is the parameter bytes per sub-group (the state swapped per
    sub-group is that times the optimizer's state size per parameter byte: 2 for Adam/AdamW,
    1 for SGD with momentum); a parameter larger than it forms its own sub-group.
    ``buffer_count`` (>= 2; 3 overlaps read, update and write) pinned buffers of one sub-group's
    state are used. ``step()`` blocks until every write finished. Not thread-safe (like torch's
    optimizers). Step pre/post hooks registered here run once per step; other hooks belong on
    :attr:`optimizer`.

    ``update_threads``: torch's intra-op threads (``torch.set_num_threads``, process-wide) for the
    wrapped optimizer's update of each sub-group, restored after it; None keeps the caller's.
    The update runs while the next sub-group is read and the previous one written: where the
    I/O threads (and, on a RAM-backed device, the kernel's copies) need the cores that torch's
    threads use, each parallel elementwise op waits for its slowest thread, and fewer threads
    finish sooner (see BENCHMARKS.md, issue 16). Elementwise optimizers (SGD, Adam, AdamW)
    give bitwise the same results with any thread count; one that reduces (a norm) may round
    differently. ``"auto"`` (the default): for ``torch.optim.SGD``, ``Adam`` and ``AdamW``
    themselves, torch's threads less the I/O handle's threads (at least 1) while their state is
    on NVMe; for any other optimizer, None.
    """

    def __init__(self, params: Iterable[Any], optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
                 *, swap_dir: str | os.PathLike[str], sub_group_bytes: int = 256 << 20,
                 buffer_count: int = 3, config: IOConfig | None = None, stale: str = "warn",
                 handle: AioHandle | None = None, update_threads: int | str | None = "auto",
                 **optimizer_kwargs: Any) -> None:
        if update_threads not in ("auto", None) and (
                isinstance(update_threads, bool) or not isinstance(update_threads, int) or update_threads < 1):
            raise ValueError(f"update_threads must be an int >= 1, 'auto' or None, got {update_threads!r}")
        if buffer_count < 2:
            raise ValueError(f"buffer_count must be >= 2 (3 overlaps read, update and write), "
                             f"got {buffer_count}")
        self.optimizer = optimizer_cls(params, **optimizer_kwargs)
        _check_cpu(self._all_params())
        for name in _HOOK_DICTS:
            setattr(self, name, OrderedDict())
        self._patch_step_function()
        self.sub_group_bytes = int(sub_group_bytes)
        self._offload: Any = None
        self._join_offload(self._all_params())
        self._probes: dict[tuple[int, torch.dtype, tuple[int, ...]], list[tuple[float, int]]] = {}
        self._groups: list[list[tuple[int, torch.Tensor]]] = []   # (group index, param)
        self._layouts: list[StateLayout | None] = []              # None: state is in memory
        bounds = self._add_sub_groups(self._all_params())
        self._swapper = TensorSwapper(swap_dir, config=config, buffer_bytes=max(bounds + [1]),
                                      buffer_count=buffer_count, min_swap_bytes=0, stale=stale,
                                      handle=handle)
        self.update_threads = update_threads if isinstance(update_threads, int) else None
        if update_threads == "auto" and type(self.optimizer) in _ELEMENTWISE:
            io_threads = self._swapper.io_config.intra_op_parallelism
            self.update_threads = max(1, torch.get_num_threads() - io_threads)

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
        return self._swapper.directory

    @property
    def num_sub_groups(self) -> int:
        return len(self._groups)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the wrapped optimizer's gradients, and those of offloaded parameters."""
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self._offload is not None:
            self._offload.zero_grad()

    def _join_offload(self, params: list[tuple[int, torch.Tensor]]) -> None:
        """Find the parameter offload holding any of ``params`` (one per optimizer), check that
        each of them can be updated within its budget, and fit the sub-groups to that budget."""
        found = _find_offload(self._all_params())
        if found is None:
            return
        found.check_updatable(p for _, p in params)
        self._offload = found
        if self.sub_group_bytes > found.update_bytes():
            self.sub_group_bytes = found.update_bytes()
            log.info("NVMeOptimizer: sub_group_bytes lowered to %d to fit the parameter "
                     "offload's budget", self.sub_group_bytes)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its parameters form new sub-groups (offloaded
        parameters among them are updated through their offload, as at construction)."""
        known = {id(p) for sub in self._groups for _, p in sub}
        n_groups, n_subs = len(self.optimizer.param_groups), len(self._groups)
        offload, sub_group_bytes = self._offload, self.sub_group_bytes
        self.optimizer.add_param_group(param_group)
        try:
            fresh = [(gi, p) for gi, p in self._all_params() if id(p) not in known]
            _check_cpu(fresh)
            self._join_offload(fresh)
            bounds = self._add_sub_groups(fresh)
            swapper = getattr(self, "_swapper", None)
            if swapper is not None and max(bounds + [0]) > swapper.buffer_bytes:
                raise ValueError(f"the new group's sub-groups need {max(bounds)} bytes of state but "
                                 f"the swap buffers hold {swapper.buffer_bytes}; create the "
                                 "NVMeOptimizer with all groups, or with a larger parameter first")
        except BaseException:  # leave the optimizer as it was: the group is not added
            self._offload, self.sub_group_bytes = offload, sub_group_bytes
            del self.optimizer.param_groups[n_groups:]
            del self._groups[n_subs:], self._layouts[n_subs:]
            for key in [k for k in self._probes if k[0] >= n_groups]:
                del self._probes[key]
            raise

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
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        writes: list[tuple[int, Future[None]]] = []
        done, current = -1, None
        try:
            n = len(self._groups)
            self._prefetch(0)
            for i in range(n):
                self._raise_failed_writes(writes)
                if i + 1 < n:
                    self._prefetch(i + 1)
                self._install(i)
                current = i
                for g in groups:
                    g["params"] = []
                for gi, p in self._groups[i]:
                    groups[gi]["params"].append(p)
                fresh = self._layouts[i] is None   # the wrapped optimizer creates its state
                self._update(i)
                done = i
                fut = self._store(i)
                if fresh and self._offload is not None:
                    self._offload.finish_updates()  # the created state left the heap: trim now
                current = None
                if fut is not None:
                    writes.append((i, fut))
        except BaseException as exc:
            for g, ps in zip(groups, saved):
                g["params"] = ps
            failed = self._settle(writes, installed=current)
            if failed is not None and isinstance(exc, SwapBufferError):
                exc = failed  # no buffer came free because a write failed: report the write
            raise self._step_error(exc, done) from exc
        for g, ps in zip(groups, saved):
            g["params"] = ps
        failed = self._settle(writes, installed=None)
        if self._offload is not None:
            self._offload.finish_updates()
        if failed is not None:
            raise self._step_error(failed, done) from failed
        return loss

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict, with every sub-group's state read back into new
        CPU tensors (so it needs memory for the whole state; it does not change the files)."""
        try:
            for i, layout in enumerate(self._layouts):
                if layout is not None:
                    raw = self._swapper.swap_in(i).result()
                    try:
                        self._install_from(i, raw, clone=True)
                    finally:
                        self._swapper.release(i)
            return self.optimizer.state_dict()
        finally:
            self._drop_swapped(range(len(self._groups)), fresh_dicts=True)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the wrapped optimizer, then write the state of every sub-group to NVMe."""
        self.optimizer.load_state_dict(state_dict)
        self._layouts = [None] * len(self._groups)
        writes = []
        for i in range(len(self._groups)):
            fut = self._store(i)
            if fut is not None:
                writes.append((i, fut))
        failed = self._settle(writes, installed=None)
        if failed is not None:
            raise failed

    def close(self) -> None:
        """Delete the swap files (the state is lost unless saved). Idempotent."""
        self._swapper.close()

    def __enter__(self) -> NVMeOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"NVMeOptimizer({type(self.optimizer).__name__}, sub_groups={len(self._groups)}, "
                f"swap_dir={self._swapper.directory!r})")

    def _update(self, i: int) -> None:
        """The wrapped optimizer's step on sub-group i (narrowed param groups), with offloaded
        parameters and gradients read in first and written back after (i+1's read ahead)."""
        offload = self._offload
        if offload is None:
            self._wrapped_step()
            return
        params = [p for _, p in self._groups[i]]
        offload.begin_update(params)
        if i + 1 < len(self._groups):
            offload.prefetch_update(p for _, p in self._groups[i + 1])
        try:
            self._wrapped_step()
        except BaseException:
            offload.abort_update(params)
            raise
        offload.end_update(params)

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

    # --- sub-groups --------------------------------------------------------------------------

    def _all_params(self) -> list[tuple[int, torch.Tensor]]:
        return [(gi, p) for gi, g in enumerate(self.optimizer.param_groups) for p in g["params"]]

    def _add_sub_groups(self, params: list[tuple[int, torch.Tensor]]) -> list[int]:
        """Partition ``params`` into new sub-groups; return each one's state size bound."""
        runs = partition([p.numel() * p.element_size() for _, p in params], self.sub_group_bytes)
        bounds = []
        for run in runs:
            members = [params[k] for k in run]
            self._groups.append(members)
            self._layouts.append(None)
            bounds.append(sum(bound_bytes([p.numel()], self._probe(gi, p)) for gi, p in members))
        return bounds

    def _probe(self, group: int, param: torch.Tensor) -> list[tuple[float, int]]:
        """State tensors per parameter element for a group's options: one tiny real step.

        The probe has the parameter's rank, each dimension cut to at most 2 (1 stays 1): state
        that depends on the shape (Adafactor's row and column factors, n + m elements for an
        (n, m) weight) gives a per-element ratio at least the real one, so the bound holds."""
        pattern = tuple(min(max(d, 1), 2) for d in param.shape)
        key = (group, param.dtype, pattern)
        if key not in self._probes:
            g = self.optimizer.param_groups[group]
            accepted = inspect.signature(type(self.optimizer)).parameters
            opts = {k: g[k] for k in self.optimizer.defaults if k in g and k in accepted}
            p = torch.zeros(pattern, dtype=param.dtype, requires_grad=True)
            p.grad = torch.ones_like(p)
            probe = type(self.optimizer)([p], **opts)
            with torch.enable_grad():
                probe.step()
            self._probes[key] = [(v.numel() / p.numel(), v.element_size())
                                 for v in probe.state[p].values() if _swapped(v)]
        return self._probes[key]

    # --- moving one sub-group's state ------------------------------------------------------

    def _prefetch(self, i: int) -> None:
        if self._layouts[i] is not None:
            self._swapper.prefetch([i])

    def _install(self, i: int) -> None:
        if self._layouts[i] is not None:
            self._install_from(i, self._swapper.swap_in(i).result(), clone=False)

    def _install_from(self, i: int, raw: torch.Tensor, *, clone: bool) -> None:
        layout = self._layouts[i]
        assert layout is not None  # callers check; internal invariant
        params = self._groups[i]
        for e in layout.entries:
            t = raw[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
            self.optimizer.state[params[e.param][1]][e.name] = t.clone() if clone else t

    def _store(self, i: int) -> Future[None] | None:
        """Pack sub-group i's swapped state into its buffer (no copy when the update ran in
        place), start writing it and drop it from memory. Returns the write's future."""
        params = self._groups[i]
        state = self.optimizer.state
        values = [(k, name, v) for k, (_, p) in enumerate(params) if p in state
                  for name, v in state[p].items() if _swapped(v)]
        layout = plan_layout([(k, name, v.dtype, tuple(v.shape)) for k, name, v in values])
        held = self._held_buffer(i)
        in_place = (held is not None and layout == self._layouts[i] and all(
            v.data_ptr() == held.data_ptr() + e.offset for (_, _, v), e in zip(values, layout.entries)))
        if not values:
            self._layouts[i] = None
            self._swapper.release(i)
            return None
        if held is None or not in_place:
            if held is not None:
                values = [(k, name, v.clone()) for k, name, v in values]
                self._swapper.release(i)
            buf = self._swapper.new_buffer(i, (layout.total,), torch.uint8)
            for (_, _, v), e in zip(values, layout.entries):
                buf[e.offset:e.offset + e.nbytes].view(v.dtype).view(v.shape).copy_(v)
            held = buf
        self._layouts[i] = layout
        fut = self._swapper.swap_out(i, held[: layout.total])
        self._swapper.release(i)
        self._drop_swapped([i])
        return fut

    def _held_buffer(self, i: int) -> torch.Tensor | None:
        if self._layouts[i] is None:
            return None
        return self._swapper.held_buffer(i)

    def _drop_swapped(self, indices: Iterable[int], *, fresh_dicts: bool = False) -> None:
        state = self.optimizer.state
        for i in indices:
            if self._layouts[i] is None and not fresh_dicts:
                continue
            for _, p in self._groups[i]:
                if p in state:
                    kept = {k: v for k, v in state[p].items()
                            if not (_swapped(v) and self._layouts[i] is not None)}
                    if fresh_dicts:
                        state[p] = kept
                    else:
                        state[p].clear()
                        state[p].update(kept)

    # --- failures ----------------------------------------------------------------------------

    def _raise_failed_writes(self, writes: list[tuple[int, Future[None]]]) -> None:
        for _, fut in writes:
            if fut.done() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]

    def _settle(self, writes: list[tuple[int, Future[None]]], *, installed: int | None
                ) -> BaseException | None:
        """Wait for every write; keep in memory the state that could not be written (and, after
        an interrupted step, the state of the sub-group being updated). Free all buffers."""
        first: BaseException | None = None
        for i, fut in writes:
            exc = fut.exception()
            if exc is None:
                continue
            first = first or exc
            raw = self._swapper.swap_in(i).result()   # the buffer kept by the failed write
            self._install_from(i, raw, clone=True)
            self._layouts[i] = None
            self._swapper.release(i, force=True)
        if installed is not None and self._layouts[installed] is not None:
            state = self.optimizer.state  # views of a buffer, maybe half updated: keep them
            for _, p in self._groups[installed]:
                for name, v in list(state.get(p, {}).items()):
                    if _swapped(v):
                        state[p][name] = v.clone()
            self._layouts[installed] = None
        for i in range(len(self._groups)):
            self._swapper.release(i)
        try:
            self._swapper.wait()
        except OSError as exc:
            first = first or exc
        return first

    def _step_error(self, exc: BaseException, done: int) -> BaseException:
        if not isinstance(exc, OSError):
            return exc
        n = len(self._groups)
        updated = f"sub-groups 0..{done} of {n} were updated" if done >= 0 else "no sub-group was updated"
        resident = [i for i, lay in enumerate(self._layouts) if lay is None]
        return SwapError(f"NVMeOptimizer.step stopped: {exc}; {updated}; the state of sub-groups "
                         f"{resident} is kept in memory", path=getattr(exc, "path", None),
                         offset=getattr(exc, "offset", None), size=getattr(exc, "size", None),
                         errno=exc.errno or errno.EIO)
