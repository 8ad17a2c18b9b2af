"""Which parameters form each optimizer sub-group, and how much state each one can have.

A sub-group is a run of consecutive parameters (with their param group's index) of at most
``sub_group_bytes`` parameter bytes, or one contiguous slice (``spans[i]``, flat element range)
of a larger parameter that an element-wise optimizer updates in slices; its state is swapped
as one packed buffer whose layout (:class:`~._layout.StateLayout`) is recorded here, None
while the state is in memory. The bound of a sub-group's packed state comes from a probe: one
tiny real step of the wrapped optimizer's class with the group's options, which shows the
state tensors it creates per parameter element.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence

import torch

from ._layout import StateLayout, bound_bytes, partition, slice_spans, swapped

__all__ = ["Member", "SubGroups"]

Member = tuple[int, torch.Tensor]   # (index of the param group, parameter)
_ProbeKey = tuple[int, torch.dtype, tuple[int, ...]]


class SubGroups:
    """The sub-groups of one wrapped optimizer: ``members[i]``, ``layouts[i]`` and ``spans[i]``
    (None: whole parameters; ``(start, stop)``: that slice of its one member) per sub-group.

    Memory: the probes cache, per (param group, dtype, rank pattern), a few numbers.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.members: list[list[Member]] = []
        self.layouts: list[StateLayout | None] = []   # None: the state is in memory
        self.spans: list[tuple[int, int] | None] = []
        self._probes: dict[_ProbeKey, list[tuple[float, int]]] = {}

    def __len__(self) -> int:
        return len(self.members)

    def params(self, i: int) -> list[torch.Tensor]:
        """The parameters of sub-group ``i``."""
        return [p for _, p in self.members[i]]

    def slices(self, i: int) -> list[int]:
        """The sub-groups holding slices of sub-group ``i``'s parameter (``i`` a slice), in order."""
        p = self.members[i][0][1]
        return [k for k, span in enumerate(self.spans) if span is not None and self.members[k][0][1] is p]

    def is_last_slice(self, i: int) -> bool:
        span = self.spans[i]
        return span is not None and span[1] == self.members[i][0][1].numel()

    def add(self, params: Sequence[Member], sub_group_bytes: int,
            sliceable: Callable[[torch.Tensor], bool] = lambda p: False) -> list[int]:
        """Partition ``params`` into new sub-groups (state in memory), a parameter over
        ``sub_group_bytes`` for which ``sliceable`` holds into slices; return each one's bound
        of packed state bytes."""
        runs = partition([p.numel() * p.element_size() for _, p in params], sub_group_bytes)
        bounds = []
        for run in runs:
            members = [params[k] for k in run]
            gi, p = members[0]
            if len(members) == 1 and p.numel() * p.element_size() > sub_group_bytes and sliceable(p):
                for span in slice_spans(p.numel(), p.element_size(), sub_group_bytes):
                    self.members.append(members)
                    self.layouts.append(None)
                    self.spans.append(span)
                    bounds.append(bound_bytes([span[1] - span[0]], self._probe(gi, p)))
                continue
            self.members.append(members)
            self.layouts.append(None)
            self.spans.append(None)
            bounds.append(sum(bound_bytes([p.numel()], self._probe(gi, p)) for gi, p in members))
        return bounds

    def truncate(self, n_subs: int, n_groups: int) -> None:
        """Forget the sub-groups from ``n_subs`` on and the probes of param groups from
        ``n_groups`` on (a param group that could not be added)."""
        del self.members[n_subs:], self.layouts[n_subs:], self.spans[n_subs:]
        for key in [k for k in self._probes if k[0] >= n_groups]:
            del self._probes[key]

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
                                 for v in probe.state[p].values() if swapped(v)]
        return self._probes[key]
