"""Moving one optimizer sub-group's state between ``optimizer.state`` and its swap file.

A sub-group's swapped state (tensors with at least one dimension) is packed into one pool buffer
of the :class:`~deepnvme.swap.TensorSwapper` at the offsets of its layout and written as one
file; installing it puts views of the buffer just read back into ``optimizer.state``, so an
update that runs in place needs no copy when the state is written again.
A sub-group holding a slice of a parameter keys its state, during its update, by a stand-in
tensor for the slice (``proxies[i]``, set by the optimizer); between updates its scalar state
(0-d tensors, numbers: Adam's ``step``) is kept per slice in ``scalars[i]``, and state that must
stay in memory (a failed write, an interrupted step) in ``held[i]``, never in
``optimizer.state`` (which holds real parameters only).
Memory: the swapper's ``buffer_count`` buffers; a failed write keeps its buffer (the only good
copy) until the state is copied back into memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future

import torch

from ..swap import TensorSwapper
from ._layout import plan_layout, swapped
from ._subgroups import SubGroups

__all__ = ["StateSwap", "Writes"]

Writes = list[tuple[int, Future[None]]]   # (sub-group, its state's write)


class StateSwap:
    """The state of ``subs``' sub-groups, each in memory or in its swap file (key: its index).

    Not thread-safe: called by the optimizer's step, state_dict and load_state_dict only.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, subs: SubGroups,
                 swapper: TensorSwapper) -> None:
        self.optimizer = optimizer
        self.subs = subs
        self.swapper = swapper
        self.proxies: dict[int, torch.Tensor] = {}   # slice sub-group -> its stand-in now
        self.held: dict[int, dict[str, torch.Tensor]] = {}   # slice sub-group -> state in memory
        self.scalars: dict[int, dict[str, object]] = {}      # slice sub-group -> its scalar state

    def owners(self, i: int) -> list[torch.Tensor]:
        """The tensors sub-group ``i``'s state is keyed by in ``optimizer.state`` now: its
        parameters, or the stand-in of its slice (none outside the slice's update)."""
        if self.subs.spans[i] is None:
            return self.subs.params(i)
        proxy = self.proxies.get(i)
        return [] if proxy is None else [proxy]

    def prefetch(self, i: int) -> None:
        """Start reading sub-group ``i``'s state (if it is in a file)."""
        if self.subs.layouts[i] is not None:
            self.swapper.prefetch([i])

    def install(self, i: int) -> None:
        """Make ``optimizer.state`` hold views of sub-group ``i``'s state read back (for a slice:
        its scalars and its held or read-back state, keyed by its stand-in); blocks."""
        if self.subs.spans[i] is not None:
            state = self.optimizer.state[self.proxies[i]]
            state.update({k: v.clone() if isinstance(v, torch.Tensor) else v
                          for k, v in self.scalars.get(i, {}).items()})
            state.update(self.held.get(i, {}))
        if self.subs.layouts[i] is not None:
            self.install_from(i, self.swapper.swap_in(i).result(), clone=False)

    def unpack(self, i: int, raw: torch.Tensor, *, clone: bool) -> list[tuple[int, str, torch.Tensor]]:
        """``(member, name, tensor)`` of sub-group ``i``'s state in ``raw`` (its layout)."""
        layout = self.subs.layouts[i]
        assert layout is not None  # callers check; internal invariant
        out = []
        for e in layout.entries:
            t = raw[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
            out.append((e.param, e.name, t.clone() if clone else t))
        return out

    def install_from(self, i: int, raw: torch.Tensor, *, clone: bool) -> None:
        """Put sub-group ``i``'s state in ``raw`` into ``optimizer.state`` (a slice's into
        ``held[i]`` when it has no stand-in now)."""
        owners = self.owners(i)
        for k, name, t in self.unpack(i, raw, clone=clone):
            if owners:
                self.optimizer.state[owners[k]][name] = t
            else:
                self.held.setdefault(i, {})[name] = t

    def read_back(self) -> None:
        """Install copies of every whole sub-group's state (the files stay as they are)."""
        for i, layout in enumerate(self.subs.layouts):
            if layout is not None and self.subs.spans[i] is None:   # slices: see _slices
                raw = self.swapper.swap_in(i).result()
                try:
                    self.install_from(i, raw, clone=True)
                finally:
                    self.swapper.release(i)

    def store(self, i: int) -> Future[None] | None:
        """Pack sub-group i's swapped state into its buffer (no copy when the update ran in
        place), start writing it and drop it from memory. Returns the write's future."""
        state = self.optimizer.state
        values = [(k, name, v) for k, p in enumerate(self.owners(i)) if p in state
                  for name, v in state[p].items() if swapped(v)]
        span = self.subs.spans[i]
        if span is not None:
            _check_slice_state(self.optimizer, self.subs.members[i][0][1], span, values)
        layout = plan_layout([(k, name, v.dtype, tuple(v.shape)) for k, name, v in values])
        held = self._held_buffer(i)
        in_place = (held is not None and layout == self.subs.layouts[i] and all(
            v.data_ptr() == held.data_ptr() + e.offset for (_, _, v), e in zip(values, layout.entries)))
        if not values:
            self.subs.layouts[i] = None
            self.held.pop(i, None)
            self.swapper.release(i)
            return None
        if held is None or not in_place:
            if held is not None:
                values = [(k, name, v.clone()) for k, name, v in values]
                self.swapper.release(i)
            buf = self.swapper.new_buffer(i, (layout.total,), torch.uint8)
            for (_, _, v), e in zip(values, layout.entries):
                buf[e.offset:e.offset + e.nbytes].view(v.dtype).view(v.shape).copy_(v)
            held = buf
        self.subs.layouts[i] = layout
        self.held.pop(i, None)
        fut = self.swapper.swap_out(i, held[: layout.total])
        self.swapper.release(i)
        self.drop([i])
        return fut

    def _held_buffer(self, i: int) -> torch.Tensor | None:
        if self.subs.layouts[i] is None:
            return None
        return self.swapper.held_buffer(i)

    def drop(self, indices: Iterable[int], *, fresh_dicts: bool = False) -> None:
        """Remove the swapped values of sub-groups ``indices`` from ``optimizer.state`` (those
        whose state is in a file); ``fresh_dicts`` gives every parameter a new state dict."""
        state = self.optimizer.state
        for i in indices:
            if self.subs.layouts[i] is None and not fresh_dicts:
                continue
            for p in self.owners(i):
                if p in state:
                    kept = {k: v for k, v in state[p].items()
                            if not (swapped(v) and self.subs.layouts[i] is not None)}
                    if fresh_dicts:
                        state[p] = kept
                    else:
                        state[p].clear()
                        state[p].update(kept)

    def settle(self, writes: Writes, *, installed: int | None) -> BaseException | None:
        """Wait for every write; keep in memory the state that could not be written (and, after
        an interrupted step, the state of the sub-group being updated). Free all buffers.
        Returns the first failure."""
        first: BaseException | None = None
        for i, fut in writes:
            exc = fut.exception()
            if exc is None:
                continue
            first = first or exc
            raw = self.swapper.swap_in(i).result()   # the buffer kept by the failed write
            self.install_from(i, raw, clone=True)
            self.subs.layouts[i] = None
            self.swapper.release(i, force=True)
        if installed is not None and self.subs.layouts[installed] is not None:
            state = self.optimizer.state  # views of a buffer, maybe half updated: keep them
            for p in self.owners(installed):
                for name, v in list(state.get(p, {}).items()):
                    if swapped(v):
                        state[p][name] = v.clone()
            self.subs.layouts[installed] = None
        for i, proxy in self.proxies.items():   # a slice's state leaves optimizer.state
            slice_state = self.optimizer.state.pop(proxy, {})
            if i == installed:
                self.held[i] = {k: v for k, v in slice_state.items() if swapped(v)}
        self.proxies.clear()
        for i in range(len(self.subs)):
            self.swapper.release(i)
        try:
            self.swapper.wait()
        except OSError as exc:
            first = first or exc
        return first


def _check_slice_state(optimizer: torch.optim.Optimizer, param: torch.Tensor,
                       span: tuple[int, int], values: list[tuple[int, str, torch.Tensor]]) -> None:
    """Refuse state of a slice that is not element-wise (one element per parameter element)."""
    n = span[1] - span[0]
    for _, name, v in values:
        if v.numel() != n:
            raise ValueError(
                f"{type(optimizer).__name__} is updated in slices (declared element-wise) but "
                f"created state {name!r} of {v.numel()} elements for a slice of {n} elements of a "
                f"parameter of shape {list(param.shape)}; its update is not element-wise: set "
                f"deepnvme_elementwise = False on the class, or raise sub_group_bytes above the "
                f"parameter's {param.numel() * param.element_size()} bytes")
