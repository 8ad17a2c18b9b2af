"""Building an offload: each parameter of a model becomes a pair of entries in the store.

Module by module (``named_modules`` order), a meta-device parameter or buffer is first
materialised from a :class:`~._sources.Source` (a checkpoint or an init function), one tensor
at a time; then each parameter's value is written to its file (its ``.data`` becomes a
placeholder), or, below ``min_offload`` bytes and while they take at most an eighth of the
budget, kept resident in memory with its gradient. Each module's own parameters form its unit.
Memory: the budget, plus the one parameter being materialised or written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ..config import IOConfig
from ..errors import OffloadMemoryError
from ._entry import Entry, placeholder
from ._sources import Init, Source, make_source
from ._store import TensorStore

__all__ = ["Built", "build"]


@dataclass
class Built:
    """The entries of an offloaded model and the units its modules fetch."""

    entries: dict[int, tuple[Entry, Entry]] = field(default_factory=dict)  # id(param) -> (data, grad)
    units: list[tuple[torch.nn.Module, str, list[Entry]]] = field(default_factory=list)


def build(model: torch.nn.Module, store: TensorStore, *, dtype: torch.dtype | None,
          source: str | os.PathLike[str] | Init | None, config: IOConfig | None,
          min_offload: int, offload_gradients: bool) -> Built:
    """Offload every parameter of ``model`` into ``store`` (see the module doc); blocks until
    every value is written. ``config`` sets the I/O of a checkpoint ``source``."""
    filler = make_source(source, config)
    try:
        builder = _Builder(model, store, filler, dtype, min_offload)
        builder.collect()
    finally:
        if filler is not None:
            filler.close()
    built = builder.built
    store.pack_resident()
    if not offload_gradients:   # as DeepSpeed's ZeRO-3 keeps its gradient partitions
        store.keep_gradients([g for d, g in built.entries.values()
                              if not g.resident and d.param.requires_grad])
    store.wait_writes()
    return built


class _Builder:
    def __init__(self, model: torch.nn.Module, store: TensorStore, filler: Source | None,
                 dtype: torch.dtype | None, min_offload: int) -> None:
        self.model = model
        self.store = store
        self.filler = filler
        self.dtype = dtype
        self.min_offload = min_offload
        self.built = Built()
        self.aliases: dict[int, list[str]] = {}
        self.meta: dict[int, tuple[torch.Tensor, torch.nn.Parameter]] = {}  # id -> (meta, new)
        self.values: dict[int, torch.Tensor] = {}   # id(new parameter) -> its value

    def collect(self) -> None:
        for n, p in self.model.named_parameters(remove_duplicate=False):
            self.aliases.setdefault(id(p), []).append(n)
        entries = self.built.entries
        for mname, module in self.model.named_modules():
            self._materialize(mname, module)
            unit: list[Entry] = []
            for p in module.parameters(recurse=False):
                if id(p) not in entries:
                    if p.numel() == 0:
                        continue
                    self._offload_one(p, self.aliases[id(p)][0], self.values.pop(id(p), None))
                data = entries[id(p)][0]
                if data not in unit:
                    unit.append(data)
            if unit:
                total = sum(e.nbytes for e in unit)
                if total > self.store.budget:
                    raise OffloadMemoryError(
                        f"module {mname or type(module).__name__!r} has {total} bytes of "
                        f"parameters, more than max_in_memory_bytes={self.store.budget}; raise it")
                self.built.units.append((module, mname, unit))

    def _materialize(self, prefix: str, module: torch.nn.Module) -> None:
        """Replace the module's meta parameters (each tied one once, everywhere) by CPU ones whose
        value comes from the source, and fill its meta buffers."""
        for key, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in self.meta:
                self._materialize_parameter(p)
            module._parameters[key] = self.meta[id(p)][1]
        for key, b in list(module._buffers.items()):
            if b is not None and b.is_meta:
                name = f"{prefix}.{key}" if prefix else key
                if self.filler is None:
                    raise ValueError(f"buffer {name} is on the meta device: pass source=")
                module._buffers[key] = self.filler.value([name], b.shape, b.dtype)

    def _materialize_parameter(self, p: torch.nn.Parameter) -> None:
        names = self.aliases[id(p)]
        if self.filler is None:
            raise ValueError(f"parameter {names[0]} is on the meta device: pass source= (a "
                             "safetensors checkpoint or an init function)")
        want = self.dtype or p.dtype
        nbytes = p.numel() * torch.empty((), dtype=want).element_size()
        with self.store.lock:
            self.store.make_room(nbytes, demand=True, what=f"building {names[0]}")
            self.store.count(nbytes)
        value = self.filler.value(names, p.shape, want)
        fresh = torch.nn.Parameter(placeholder(p.shape, want), requires_grad=p.requires_grad)
        self.meta[id(p)] = (p, fresh)
        self.values[id(fresh)] = value
        self.aliases[id(fresh)] = names
        for m in self.model.modules():  # the same parameter in every module holding it
            for k, q in m._parameters.items():
                if q is p:
                    m._parameters[k] = fresh

    def _offload_one(self, p: torch.nn.Parameter, name: str, value: torch.Tensor | None) -> None:
        if value is None:
            if p.device.type != "cpu":
                raise ValueError(f"offload_parameters needs CPU parameters; {name} is on {p.device}")
            if self.dtype is not None and p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)
            value = p.data
            self.store.admit(value.numel() * value.element_size(), f"parameter {name}")  # until written
        entries = self.built.entries
        key = 2 * len(entries)
        data = Entry(key, name, p, grad=False)
        grad = Entry(key + 1, name, p, grad=True)
        entries[id(p)] = (data, grad)
        store = self.store
        if (data.nbytes < self.min_offload
                and store.resident_bytes + 3 * data.nbytes <= store.budget // 8):
            store.make_resident(data, grad, value)
            p.data = value
        else:
            store.store(data, value, keep=False)
            p.data = placeholder(data.shape, data.dtype)
