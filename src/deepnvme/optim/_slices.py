"""Updating a large parameter in slices: one optimizer sub-group per contiguous slice.

An element-wise optimizer updates each element of a parameter from the same element of its
gradient and of each state tensor, plus scalar state that is the same for the whole parameter
(numbers and 0-d tensors, such as Adam's ``step``); it then gives the same bits whether it
updates a parameter whole or slice by slice. Torch's SGD, Adam and AdamW are taken as
element-wise (for each of their single-tensor, foreach and fused kernels); another optimizer
class declares it with the class attribute ``deepnvme_elementwise = True`` (``False`` takes a
built-in one out). For each slice a stand-in parameter (a 1-D view of the slice, with the
gradient's slice as ``.grad``) takes the parameter's place in the narrowed param group; its state
is the slice's, read from the slice's own swap file, plus the slice's own copy of the scalar
state, which advances once per step like the parameter's (``optimizer.state[param]`` shows it).
Memory: one slice's state (and, with a parameter offload, one slice of the parameter and of its
gradient, plus the next one read ahead) instead of the whole parameter's.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

import torch

from ._layout import swapped
from ._state import StateSwap
from ._subgroups import SubGroups

__all__ = ["ELEMENTWISE_ATTRIBUTE", "Slices", "is_elementwise"]

log = logging.getLogger(__name__)

#: the class attribute by which an optimizer declares its update element-wise (True or False)
ELEMENTWISE_ATTRIBUTE = "deepnvme_elementwise"
_BUILTIN = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


def is_elementwise(cls: type) -> bool:
    """True if ``cls`` declares (``deepnvme_elementwise``) or is known to update element-wise;
    a built-in class counts only exactly, not a subclass that may change its ``step``."""
    declared = cls.__dict__.get(ELEMENTWISE_ATTRIBUTE, getattr(cls, ELEMENTWISE_ATTRIBUTE, None))
    if declared is not None:
        return declared is True
    return cls in _BUILTIN


class Slices:
    """The stand-ins of the slice sub-groups being updated, and the whole-parameter views of
    their state for ``state_dict``/``load_state_dict``. Not thread-safe (the optimizer's)."""

    def __init__(self, optimizer: torch.optim.Optimizer, subs: SubGroups, state: StateSwap) -> None:
        self.optimizer = optimizer
        self.subs = subs
        self.state = state

    def param(self, i: int) -> torch.Tensor:
        return self.subs.members[i][0][1]

    def open(self, i: int) -> None:
        """Make slice sub-group ``i``'s stand-in (no data yet); nothing for whole sub-groups."""
        if self.subs.spans[i] is None:
            return
        p = self.param(i)
        self.state.proxies[i] = torch.nn.Parameter(torch.empty(0, dtype=p.dtype),
                                                   requires_grad=p.requires_grad)

    def in_memory(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The slice of a parameter held in memory and of its gradient (views where possible)."""
        p, span = self.param(i), self.subs.spans[i]
        assert span is not None  # a slice sub-group; internal invariant
        if not p.data.is_contiguous():
            raise ValueError(f"a parameter of shape {list(p.shape)} is updated in slices but is "
                             "no longer contiguous (its .data was replaced); keep it contiguous")
        grad = p.grad
        return (p.data.view(-1)[span[0]:span[1]],
                None if grad is None else grad.reshape(-1)[span[0]:span[1]])

    def bind(self, i: int, data: torch.Tensor, grad: torch.Tensor | None) -> None:
        proxy = self.state.proxies[i]
        proxy.data = data
        proxy.grad = grad

    def unbind(self, i: int) -> None:
        """Let the stand-in go of the slice's data and gradient (their buffers may be reused)."""
        proxy = self.state.proxies.get(i)
        if proxy is not None:
            proxy.grad = None
            proxy.data = torch.empty(0, dtype=proxy.dtype)

    def close(self, i: int) -> None:
        """After the slice's state was stored: keep its scalar state, show it on the parameter,
        and drop the stand-in from ``optimizer.state``."""
        proxy = self.state.proxies.pop(i, None)
        if proxy is None:
            return
        left = self.optimizer.state.pop(proxy, {})
        scalars = {k: v for k, v in left.items() if not swapped(v)}
        if scalars or i in self.state.scalars:
            self.state.scalars[i] = scalars
            self.optimizer.state[self.param(i)] = dict(scalars)

    def by_param(self) -> list[tuple[torch.Tensor, list[int]]]:
        """Each sliced parameter with its slice sub-groups, in order."""
        found: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for i, span in enumerate(self.subs.spans):
            if span is not None:
                p = self.param(i)
                found.setdefault(id(p), (p, []))[1].append(i)
        return list(found.values())

    # --- whole-parameter state for state_dict / load_state_dict ----------------------------

    def assemble(self) -> None:
        """Put copies of every sliced parameter's whole state into ``optimizer.state`` (its
        shape, from each slice's file or held state), with the scalars of its first slice."""
        for p, slices in self.by_param():
            parts = [self._slice_state(i) for i in slices]
            have = [bool(part) for part in parts]
            if not any(have):
                continue
            names = set().union(*(part.keys() for part in parts))
            if not all(have) or any(set(part) != names for part in parts):
                raise RuntimeError(f"the optimizer state of a parameter of shape {list(p.shape)} "
                                   "is incomplete: a step stopped during its slices; finish a "
                                   "step before state_dict()")
            full = {}
            for name in names:
                first = parts[0][name]
                full[name] = torch.empty(p.numel(), dtype=first.dtype)
                for i, part in zip(slices, parts):
                    a, b = self.subs.spans[i] or (0, 0)
                    full[name][a:b].copy_(part[name].reshape(-1))
            scalars = [self.state.scalars.get(i, {}) for i in slices]
            if any(not _same(s, scalars[0]) for s in scalars):
                log.warning("NVMeOptimizer: the slices of a parameter of shape %s differ in their "
                            "scalar state (a step stopped during its slices); state_dict shows "
                            "the first slice's", list(p.shape))
            self.optimizer.state[p] = {**scalars[0],
                                       **{n: t.view(p.shape) for n, t in full.items()}}

    def _slice_state(self, i: int) -> dict[str, torch.Tensor]:
        """Sub-group ``i``'s state tensors (copies read back from its file, or held ones)."""
        if self.subs.layouts[i] is not None:
            raw = self.state.swapper.swap_in(i).result()
            try:
                return {name: t for _, name, t in self.state.unpack(i, raw, clone=True)}
            finally:
                self.state.swapper.release(i)
        return dict(self.state.held.get(i, {}))

    def strip(self) -> None:
        """Leave only the scalar state of sliced parameters in ``optimizer.state``."""
        for p, _ in self.by_param():
            if p in self.optimizer.state:
                self.optimizer.state[p] = {k: v for k, v in self.optimizer.state[p].items()
                                           if not swapped(v)}

    def split_loaded(self) -> list[tuple[int, Future[None]]]:
        """After ``load_state_dict``: write each sliced parameter's loaded state slice by slice
        (each slice gets its copy of the scalars) and leave only the scalars in
        ``optimizer.state``. Returns the writes."""
        writes: list[tuple[int, Future[None]]] = []
        for p, slices in self.by_param():
            loaded = self.optimizer.state.get(p, {})
            scalars = {k: v for k, v in loaded.items() if not swapped(v)}
            whole = {k: v for k, v in loaded.items() if swapped(v)}
            for i in slices:
                a, b = self.subs.spans[i] or (0, 0)
                self.state.held.pop(i, None)
                if not loaded:
                    self.state.scalars.pop(i, None)
                    continue
                self.state.scalars[i] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                         for k, v in scalars.items()}
                self.open(i)
                self.optimizer.state[self.state.proxies[i]] = {
                    k: v.reshape(-1)[a:b] for k, v in whole.items()}
                try:
                    fut = self.state.store(i)
                finally:
                    self.optimizer.state.pop(self.state.proxies.pop(i), None)
                if fut is not None:
                    writes.append((i, fut))
            if loaded:
                self.optimizer.state[p] = scalars
        return writes


def _same(a: dict[str, object], b: dict[str, object]) -> bool:
    if a.keys() != b.keys():
        return False
    for k, v in a.items():
        w = b[k]
        if isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor):
            if not torch.equal(v, w):
                return False
        elif v != w:
            return False
    return True
