"""The offload of a ``fully_shard``-ed (FSDP2) model: each rank offloads only its own shards.

Each FSDP2 parameter group is a unit. Its shards are fetched (pinned) just before the group's
all-gather reads them and unpinned once it returned; the next ``prefetch`` groups in the learned
all-gather order are read ahead. The order is learned as FSDP issues its all-gathers (FSDP's own
forward and backward prefetches included), one pass being a forward and the backward after it.
A shard's reduce-scattered gradient reaches the DTensor parameter's post-accumulate-grad hook
(FSDP2 calls it after the reduce-scatter) and goes to the store as a single-process gradient
does. A shard all-gathered for the backward is needed again by its update (fused into the
backward, right after the reduce-scatter): until its gradient arrives it is *awaited*, evicted
last and never to make room for a read ahead, so the update does not read it again; the
optimizer is told then (``store.on_awaited``), so it reads the update's state during the group's
backward rather than at its update.
:class:`~deepnvme.NVMeOptimizer` updates the plain local parameters (:attr:`Shard.local`).

Memory: the store's budget (shards, gradients, reads ahead). FSDP's all-gather and
reduce-scatter buffers and its unsharded parameters are FSDP's own, as the activations are the
training loop's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from ..errors import OffloadMemoryError
from ._entry import Entry
from ._fsdp import Group, Shard, fsdp_groups, wrap_unshard
from ._gradients import accept_gradient
from ._order import OrderTracker
from ._store import TensorStore

__all__ = ["ShardHooks", "ShardedBuilt", "build_shards"]


@dataclass
class ShardedBuilt:
    """The entries of an FSDP2 model's shards on this rank, and its groups as units."""

    entries: dict[int, tuple[Entry, Entry]] = field(default_factory=dict)     # id(local param) ->
    by_dtensor: dict[int, tuple[Entry, Entry]] = field(default_factory=dict)  # id(DTensor param) ->
    units: list[tuple[Group, list[Entry]]] = field(default_factory=list)


def build_shards(model: torch.nn.Module, store: TensorStore, *, min_offload: int,
                 offload_gradients: bool) -> ShardedBuilt:
    """Write this rank's shards of ``model`` into ``store`` (small ones kept resident, as
    :func:`~._build.build` keeps small parameters); blocks until every value is written."""
    names = {id(p): n for n, p in model.named_parameters()}
    built = ShardedBuilt()
    held: set[int] = set()
    for group in fsdp_groups(model):
        unit = [_offload_shard(store, built, Shard(fp), names, min_offload) for fp in group.params]
        held.update(id(fp.sharded_param) for fp in group.params)
        total = sum(e.nbytes for e in unit)
        if total > store.budget:
            raise OffloadMemoryError(
                f"the FSDP group of module {group.name or 'root'!r} has {total} bytes of shards "
                f"on this rank, more than max_in_memory_bytes={store.budget}; raise it or "
                "apply fully_shard to smaller modules")
        built.units.append((group, unit))
    loose = [n for n, p in model.named_parameters() if id(p) not in held]
    if loose:
        raise ValueError(f"offload_parameters: parameters {loose[:4]} are not managed by FSDP2; "
                         "apply fully_shard to the root module too (it takes the rest)")
    store.pack_resident()
    if not offload_gradients:
        store.keep_gradients([g for d, g in built.entries.values()
                              if not g.resident and d.param.requires_grad])
    store.wait_writes()
    return built


def _offload_shard(store: TensorStore, built: ShardedBuilt, shard: Shard, names: dict[int, str],
                   min_offload: int) -> Entry:
    name = names.get(id(shard.dtensor), f"shard {len(built.entries)}")
    key = 2 * len(built.entries)
    data = Entry(key, name, shard.local, grad=False, home=shard)
    grad = Entry(key + 1, name, shard.local, grad=True)
    built.entries[id(shard.local)] = built.by_dtensor[id(shard.dtensor)] = (data, grad)
    value = shard.value()
    store.admit(data.nbytes, f"shard of {name}")   # until written
    if (data.nbytes < min_offload
            and store.resident_bytes + 3 * data.nbytes <= store.budget // 8):
        store.make_resident(data, grad, value)   # moved by pack_resident
    else:
        store.store(data, value, keep=False)
        shard.hide()
    return data


class ShardHooks:
    """The all-gather wrappers and gradient hooks of one offloaded FSDP2 model (see the
    module doc); :meth:`remove` undoes them. Memory: references to the units only."""

    def __init__(self, model: torch.nn.Module, store: TensorStore, built: ShardedBuilt,
                 prefetch: int) -> None:
        self._store = store
        self._built = built
        self._order = OrderTracker(prefetch)
        self._undo = [wrap_unshard(group.group, self._before(i, group.name, unit), self._after(unit))
                      for i, (group, unit) in enumerate(built.units)]
        self._handles: list[RemovableHandle] = [
            model.register_forward_pre_hook(self._start, prepend=True)]
        for group, _ in built.units:
            for fp in group.params:
                if fp.sharded_param.requires_grad:
                    self._handles.append(
                        fp.sharded_param.register_post_accumulate_grad_hook(self._on_grad))

    def _start(self, module: torch.nn.Module, args: Any) -> None:
        self._order.start()
        with self._store.lock:   # a backward that gave some shard no gradient
            for _, unit in self._built.units:
                for e in unit:
                    e.awaited = False

    def _before(self, index: int, name: str, unit: list[Entry]) -> Any:
        what = f"the all-gather of FSDP module {name or 'root'!r}"

        def before() -> None:
            self._store.fetch(unit, what)
            ahead = self._order.visit(index)
            if ahead:
                self._store.prefetch(e for u in ahead for e in self._built.units[u][1])
        return before

    def _after(self, unit: list[Entry]) -> Any:
        wanted = [e for e in unit if e.param.requires_grad and not e.resident]

        def after() -> None:
            with self._store.lock:
                self._store.unpin(unit)
                backward = _in_backward()
                if backward:
                    for e in wanted:
                        e.awaited = e.tensor is not None
                notice = self._store.on_awaited
            if backward and notice is not None and wanted:
                notice([e.param for e in wanted])   # their update's state can be read now
        return after

    def _on_grad(self, p: torch.Tensor) -> None:
        grad, p.grad = p.grad, None
        if grad is None:
            return
        with torch.no_grad():
            local = grad.to_local() if hasattr(grad, "to_local") else grad
        data, entry = self._built.by_dtensor[id(p)]
        try:
            accept_gradient(self._store, entry, local)
        finally:
            data.awaited = False

    def remove(self) -> None:
        for undo in self._undo:
            undo()
        self._undo.clear()
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _in_backward() -> bool:
    """Whether autograd is running a backward on this thread (FSDP2's pre-backward all-gathers)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and int(task_id()) >= 0
