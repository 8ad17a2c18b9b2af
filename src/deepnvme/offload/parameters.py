"""``offload_parameters``: a torch model whose parameters and gradients live in files.

Hooks bring parameters in when autograd or a module needs them, and send gradients out as
autograd produces them:

- forward: a module's pre-hook reads its own parameters (``recurse=False``) and pins them; the
  post-hook unpins them. The next ``prefetch`` modules in the learned execution order are read
  ahead. Saved-tensor hooks replace every saved parameter (or view of one) by a reference, so
  the forward keeps no parameter memory alive for the backward.
- backward: unpacking a saved reference reads the parameter again (prefetching the next ones
  in the learned backward order); a parameter's post-accumulate-grad hook takes its gradient,
  adds it to the one stored (gradient accumulation, as ``param.grad += grad`` does) and writes it.
- :class:`~deepnvme.NVMeOptimizer` finds the offload through the parameters and reads each
  sub-group's parameters and gradients, updates, and writes the parameters back.

Parameters are evicted lazily (least recently used, unpinned) when room is needed. Buffers
(e.g. BatchNorm statistics) stay in memory. Parameters are present only inside a module's
forward, backward unpacking and optimizer updates; read them otherwise with
:meth:`ParameterOffload.parameter` or :meth:`ParameterOffload.state_dict`.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from ..config import IOConfig
from ..errors import OffloadMemoryError
from ._gradients import accept_gradient
from ._order import OrderTracker
from ._sources import Init, Source, make_source
from ._store import Entry, TensorStore, placeholder
from ._updates import UpdateSide

__all__ = ["OffloadStats", "ParameterOffload", "offload_parameters", "register_external_parameter"]

log = logging.getLogger(__name__)

STORE_ATTRIBUTE = "_deepnvme_offload"   # set on each offloaded Parameter: its ParameterOffload
#: parameters smaller than this (bytes) stay in memory with their gradients, by default
MIN_OFFLOAD_BYTES = 64 << 10


@dataclass(frozen=True)
class OffloadStats:
    """Bytes held and moved since the offload began (or since :meth:`ParameterOffload.reset_stats`)."""

    budget_bytes: int
    held_bytes: int
    peak_bytes: int
    bytes_read: int
    bytes_written: int
    prefetch_hits: int  # parameter reads that a prefetch had started before they were needed
    buffers_reused: int = 0  # reads and gradient copies served by a free buffer (no new mapping)


class _SavedParam:
    """What autograd keeps instead of a saved parameter (or a view of one)."""

    __slots__ = ("entry", "size", "stride", "offset")

    def __init__(self, entry: Entry, t: torch.Tensor, base: torch.Tensor) -> None:
        # the offset is relative to the parameter's data: a later read lands elsewhere
        self.entry, self.size, self.stride = entry, t.size(), t.stride()
        self.offset = t.storage_offset() - base.storage_offset()


class ParameterOffload(UpdateSide):
    """The offload of one model's parameters and gradients (see :func:`offload_parameters`)."""

    def __init__(self, model: torch.nn.Module, directory: str | os.PathLike[str], *,
                 max_in_memory_bytes: int, prefetch: int = 2, dtype: torch.dtype | None = None,
                 config: IOConfig | None = None,
                 source: str | os.PathLike[str] | Init | None = None,
                 min_offload_bytes: int | None = None, offload_gradients: bool = True) -> None:
        if max_in_memory_bytes < 1:
            raise OffloadMemoryError(f"max_in_memory_bytes must be >= 1, got {max_in_memory_bytes}")
        if min_offload_bytes is not None and min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be >= 0, got {min_offload_bytes}")
        self.model = model
        self._min_offload = MIN_OFFLOAD_BYTES if min_offload_bytes is None else min_offload_bytes
        self.offload_gradients = bool(offload_gradients)
        self._store = TensorStore(directory, budget=max_in_memory_bytes, config=config)
        self._forward = OrderTracker(prefetch)
        self._backward = OrderTracker(prefetch)
        self._entries: dict[int, tuple[Entry, Entry]] = {}    # id(param) -> (data, grad)
        self._units: list[list[Entry]] = []                    # per module with parameters
        self._unit_index: dict[int, int] = {}                  # id(module) -> its unit
        self._root_hooked = False                              # _install_hooks has run
        self._unit_of: dict[int, int] = {}                     # entry key -> first unit
        self._pushed: list[tuple[int, saved_tensors_hooks]] = []
        self._backward_pending = False
        self._hooks: list[Any] = []
        self._meta: dict[int, tuple[torch.Tensor, torch.nn.Parameter]] = {}  # id -> (meta, new)
        self._values: dict[int, torch.Tensor] = {}   # id(new parameter) -> its value
        filler = make_source(source, config)
        try:
            self._collect(dtype, filler)
            self._install_hooks()
        except BaseException:
            self.close()
            raise
        finally:
            self._meta.clear()
            self._values.clear()
            if filler is not None:
                filler.close()

    # --- setup --------------------------------------------------------------------------

    def _collect(self, dtype: torch.dtype | None, filler: Source | None) -> None:
        aliases: dict[int, list[str]] = {}
        for n, p in self.model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(n)
        for mname, module in self.model.named_modules():
            self._materialize(mname, module, aliases, filler, dtype)
            unit: list[Entry] = []
            for p in module.parameters(recurse=False):
                if id(p) not in self._entries:
                    if p.numel() == 0:
                        continue
                    self._offload_one(p, aliases[id(p)][0], dtype, self._values.pop(id(p), None))
                data = self._entries[id(p)][0]
                if data not in unit:
                    unit.append(data)
                    self._unit_of.setdefault(data.key, len(self._units))
            if unit:
                total = sum(e.nbytes for e in unit)
                if total > self._store.budget:
                    raise OffloadMemoryError(
                        f"module {mname or type(module).__name__!r} has {total} bytes of "
                        f"parameters, more than max_in_memory_bytes={self._store.budget}; raise it")
                self._add_unit(module, mname, unit)
        self._store.pack_resident()
        if not self.offload_gradients:   # as DeepSpeed's ZeRO-3 keeps its gradient partitions
            self._store.keep_gradients([g for d, g in self._entries.values()
                                        if not g.resident and d.param.requires_grad])
        self._store.wait_writes()

    def _materialize(self, prefix: str, module: torch.nn.Module, aliases: dict[int, list[str]],
                     filler: Source | None, dtype: torch.dtype | None) -> None:
        """Replace the module's meta parameters (each tied one once, everywhere) by CPU ones whose
        value comes from ``filler``, and fill its meta buffers."""
        for key, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in self._meta:
                if filler is None:
                    raise ValueError(f"parameter {aliases[id(p)][0]} is on the meta device: pass "
                                     "source= (a safetensors checkpoint or an init function)")
                want = dtype or p.dtype
                nbytes = p.numel() * torch.empty((), dtype=want).element_size()
                with self._store.lock:
                    self._store.make_room(nbytes, demand=True, what=f"building {aliases[id(p)][0]}")
                    self._store.count(nbytes)
                value = filler.value(aliases[id(p)], p.shape, want)
                fresh = torch.nn.Parameter(placeholder(p.shape, want), requires_grad=p.requires_grad)
                self._meta[id(p)] = (p, fresh)
                self._values[id(fresh)] = value
                aliases[id(fresh)] = aliases[id(p)]
                for m in self.model.modules():  # the same parameter in every module holding it
                    for k, q in m._parameters.items():
                        if q is p:
                            m._parameters[k] = fresh
            module._parameters[key] = self._meta[id(p)][1]
        for key, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                name = f"{prefix}.{key}" if prefix else key
                if filler is None:
                    raise ValueError(f"buffer {name} is on the meta device: pass source=")
                module._buffers[key] = filler.value([name], b.shape, b.dtype)

    def _offload_one(self, p: torch.nn.Parameter, name: str, dtype: torch.dtype | None,
                     value: torch.Tensor | None) -> None:
        if value is None:
            if p.device.type != "cpu":
                raise ValueError(f"offload_parameters needs CPU parameters; {name} is on {p.device}")
            if dtype is not None and p.dtype != dtype:
                p.data = p.data.to(dtype)
            value = p.data
            self._store.count(value.numel() * value.element_size())  # until written
        key = 2 * len(self._entries)
        data = Entry(key, name, p, grad=False)
        grad = Entry(key + 1, name, p, grad=True)
        self._entries[id(p)] = (data, grad)
        store = self._store
        if (data.nbytes < self._min_offload
                and store.resident_bytes + 3 * data.nbytes <= store.budget // 8):
            store.make_resident(data, grad, value)
            p.data = value
        else:
            store.store(data, value, keep=False)
            p.data = placeholder(data.shape, data.dtype)
        setattr(p, STORE_ATTRIBUTE, self)
        if p.requires_grad:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _add_unit(self, module: torch.nn.Module, name: str, unit: list[Entry]) -> None:
        """Fetch ``unit`` before ``module``'s forward and release it after. A unit added to the
        root module after the offload's own root hooks exist nests inside them: its pre-hook
        runs after the root's, its forward hook before."""
        index = len(self._units)
        self._units.append(unit)
        self._unit_index[id(module)] = index
        root = module is self.model and self._root_hooked
        self._hooks.append(module.register_forward_pre_hook(self._pre_hook(index, name),
                                                            prepend=not root))
        self._hooks.append(module.register_forward_hook(self._post_hook(index), prepend=root,
                                                        always_call=True))

    def register_external_parameter(self, module: torch.nn.Module,
                                    parameter: torch.nn.Parameter) -> None:
        """Fetch ``parameter`` for ``module``'s forward too (and keep it for its backward).

        For a parameter that ``module``'s own forward uses although another module owns it, e.g.
        ``F.linear(h, self.embed.weight)`` in the root module: each module's hooks fetch only the
        parameters it owns, so outside them an offloaded parameter holds its placeholder (NaN).
        DeepSpeed's ``deepspeed.zero.register_external_parameter`` does the same for ZeRO-3.
        """
        pair = self._entries.get(id(parameter))
        if pair is None:
            raise ValueError("register_external_parameter: the parameter (shape "
                             f"{list(parameter.shape)}) is not one of the offloaded model's")
        name = next((n for n, m in self.model.named_modules() if m is module), None)
        if name is None:
            raise ValueError(f"register_external_parameter: the module {type(module).__name__} "
                             "is not part of the offloaded model")
        data = pair[0]
        index = self._unit_index.get(id(module))
        unit = [] if index is None else self._units[index]
        if data in unit:
            return
        total = sum(e.nbytes for e in unit) + data.nbytes
        if total > self._store.budget:
            raise OffloadMemoryError(
                f"module {name or type(module).__name__!r} would need {total} bytes of parameters "
                f"with {data.name}, more than max_in_memory_bytes={self._store.budget}; raise it")
        if index is None:
            self._add_unit(module, name, [data])
        else:
            unit.append(data)

    def _install_hooks(self) -> None:
        self._hooks.append(self.model.register_forward_pre_hook(self._root_pre, prepend=True))
        self._hooks.append(self.model.register_forward_hook(self._root_post, always_call=True))
        self._root_hooked = True

    # --- forward ------------------------------------------------------------------------

    def _push(self, owner: int) -> None:
        ctx = saved_tensors_hooks(self._pack, self._unpack)
        ctx.__enter__()
        self._pushed.append((owner, ctx))

    def _pop(self, owner: int) -> bool:
        """Undo ``owner``'s push; False if its pre-hook failed before pushing."""
        if self._pushed and self._pushed[-1][0] == owner:
            self._pushed.pop()[1].__exit__(None, None, None)
            return True
        return False

    def _root_pre(self, module: torch.nn.Module, args: Any) -> None:
        self._forward.start()
        self._backward_pending = torch.is_grad_enabled()
        self._push(-1)

    def _root_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self._pop(-1)

    def _pre_hook(self, unit: int, name: str) -> Any:
        entries = self._units[unit]
        what = f"module {name or 'root'!r}"

        def hook(module: torch.nn.Module, args: Any) -> None:
            self._store.fetch(entries, what)
            self._push(unit)
            ahead = self._forward.visit(unit)
            if ahead:
                self._store.prefetch(e for u in ahead for e in self._units[u])
        return hook

    def _post_hook(self, unit: int) -> Any:
        def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
            if self._pop(unit):
                self._store.unpin(self._units[unit])
        return hook

    # --- autograd -----------------------------------------------------------------------

    def _pack(self, t: torch.Tensor) -> Any:
        if t.device.type != "cpu" or t.numel() == 0:
            return t
        entry = self._store.by_storage.get(t.untyped_storage().data_ptr())
        if entry is None or t.dtype != entry.dtype or entry.tensor is None:
            return t
        return _SavedParam(entry, t, entry.tensor)

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedParam):
            return saved  # type: ignore[no-any-return]
        entry = saved.entry
        if self._backward_pending:
            self._backward.start()
            self._backward_pending = False
        self._store.fetch([entry], f"parameter {entry.name} (backward)")
        try:
            assert entry.tensor is not None  # fetch made it present; internal invariant
            view = entry.tensor.as_strided(saved.size, saved.stride,
                                           entry.tensor.storage_offset() + saved.offset)
            ahead = self._backward.visit(self._unit_of[entry.key])
            if ahead:
                self._store.prefetch(e for u in ahead for e in self._units[u])
        finally:
            self._store.unpin([entry])
        return view

    def _on_grad(self, p: torch.Tensor) -> None:
        grad, p.grad = p.grad, None
        if grad is not None:
            accept_gradient(self._store, self._entries[id(p)][1], grad)

    # --- the user's side ----------------------------------------------------------------

    def zero_grad(self) -> None:
        """Forget every stored gradient (as ``optimizer.zero_grad()``; no I/O)."""
        with self._store.lock:
            for _, g in self._entries.values():
                g.valid = False
                if g.pins == 0:
                    self._store.drop(g)

    def _named(self, name: str) -> tuple[Entry, Entry]:
        for d, g in self._entries.values():
            if d.name == name:
                return d, g
        raise KeyError(f"no offloaded parameter named {name!r}")

    def _copy(self, entry: Entry) -> torch.Tensor:
        self._store.fetch([entry], f"reading {entry.name}")
        try:
            assert entry.tensor is not None  # fetch made it present; internal invariant
            return entry.tensor.clone()
        finally:
            self._store.unpin([entry])

    def parameter(self, name: str) -> torch.Tensor:
        """A copy of the parameter ``name`` (its qualified name in the model)."""
        return self._copy(self._named(name)[0])

    def gradient(self, name: str) -> torch.Tensor | None:
        """A copy of the accumulated gradient of ``name``, or None (none since zero_grad)."""
        grad = self._named(name)[1]
        return self._copy(grad) if grad.valid else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict with copies of the parameters read back (needs their memory)."""
        out: dict[str, torch.Tensor] = {}
        for name, value in self.model.state_dict(keep_vars=True).items():
            pair = self._entries.get(id(value))
            out[name] = self._copy(pair[0]) if pair is not None else value.detach()
        return out

    def stats(self) -> OffloadStats:
        s = self._store
        return OffloadStats(budget_bytes=s.budget, held_bytes=s.held, peak_bytes=s.peak,
                            bytes_read=s.bytes_read, bytes_written=s.bytes_written,
                            prefetch_hits=s.prefetch_hits, buffers_reused=s.reused)

    def reset_stats(self) -> None:
        s = self._store
        s.peak, s.bytes_read, s.bytes_written, s.prefetch_hits, s.reused = s.held, 0, 0, 0, 0

    @property
    def directory(self) -> str:
        """The private directory holding the parameter and gradient files."""
        return self._store.swapper.directory

    def close(self) -> None:
        """Remove the hooks and delete the files (the parameters are lost unless read back)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._store.close()

    def __enter__(self) -> ParameterOffload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def offload_parameters(model: torch.nn.Module, directory: str | os.PathLike[str], *,
                       max_in_memory_bytes: int, prefetch: int = 2,
                       dtype: torch.dtype | None = None,
                       config: IOConfig | None = None,
                       source: str | os.PathLike[str] | Init | None = None,
                       min_offload_bytes: int | None = None,
                       offload_gradients: bool = True) -> ParameterOffload:
    """Move ``model``'s parameters (and, in training, their gradients) to files under ``directory``.

    Each submodule's own parameters are read in before its forward and again when the backward
    needs them, the next ``prefetch`` modules in execution order are read ahead (the order is
    learned on the first pass and re-learned when it changes), and gradients are written as
    autograd produces them, accumulated across backward passes until ``zero_grad``.
    ``dtype`` converts the parameters first; ``config`` sets the I/O engine.

    A model built on the meta device (``with torch.device("meta"): model = Net()``) never
    exists whole in memory: ``source`` gives each meta parameter (and buffer) its value, one
    at a time, written to its file before the next: a safetensors checkpoint (a file, or a
    folder with ``model.safetensors`` or a sharded index; names as in ``model.state_dict()``)
    or a function ``init(name, tensor)`` filling an uninitialised tensor in place.

    Memory: ``max_in_memory_bytes`` (parameters and gradients, reads in flight, writes not
    yet finished and free buffers kept for reuse by the next read of the same size included)
    + the one gradient that autograd just produced (its page-aligned copy for the write is a
    store buffer, within the budget, unless every buffer is pinned) + the
    NVMeOptimizer's ``buffer_count x`` one sub-group's state; the I/O buffers are
    the tensors themselves (page-aligned, so the engine needs no bounce buffers). Activations
    and the optimizer's temporaries are the training loop's own, as in memory. Each module's
    own parameters, and each optimizer sub-group's parameters plus gradients, must fit the
    budget (checked when the offload and the optimizer are built: a parameter larger than the
    budget, or than half of it for its update, is refused with
    :class:`~deepnvme.OffloadMemoryError` naming it); if a module needs more than is free while
    everything is pinned, that error is raised too.
    Parameters smaller than ``min_offload_bytes`` (default :data:`MIN_OFFLOAD_BYTES`, 64 KiB:
    biases, norm weights) stay in memory with their gradients, as DeepSpeed's
    ``stage3_param_persistence_threshold`` keeps small parameters: each would otherwise cost a
    file request per use for a few KiB. They count in ``max_in_memory_bytes`` for good (3 x
    their size: value, gradient, a copy for a failed update), at most an eighth of it (further
    small ones are offloaded); 0 offloads every parameter.
    ``offload_gradients=False`` keeps every gradient in memory instead (one mapping of the
    parameters' size, outside ``max_in_memory_bytes``), as DeepSpeed's ZeRO-3 keeps its gradient
    partitions: each step then moves two fewer passes over the parameters' bytes (no gradient
    written after the backward and read back for the update), for memory the size of the model.
    Train with :class:`~deepnvme.NVMeOptimizer`, which reads and writes the offloaded tensors.
    """
    return ParameterOffload(model, directory, max_in_memory_bytes=max_in_memory_bytes,
                            prefetch=prefetch, dtype=dtype, config=config, source=source,
                            min_offload_bytes=min_offload_bytes,
                            offload_gradients=offload_gradients)


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Make ``module``'s forward fetch ``parameter``, an offloaded parameter that another module
    owns (see :meth:`ParameterOffload.register_external_parameter`); the name and use of
    DeepSpeed's ``deepspeed.zero.register_external_parameter``."""
    offload = getattr(parameter, STORE_ATTRIBUTE, None)
    if not isinstance(offload, ParameterOffload):
        raise ValueError("register_external_parameter: the parameter (shape "
                         f"{list(parameter.shape)}) is not offloaded; call offload_parameters first")
    offload.register_external_parameter(module, parameter)
