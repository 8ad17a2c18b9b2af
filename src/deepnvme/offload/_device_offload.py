"""Training a model on a GPU with its parameters offloaded: the master copy in files, the update
on the CPU, each parameter copied to the device ahead of use (ZeRO-Infinity's parameter path).

:func:`offload_parameters` sends a model whose parameters are on a CUDA device here, and any
other model to :func:`~deepnvme.offload.parameters.offload_parameters`. The model's parameters
keep their identity and device; between uses each holds a one-element device placeholder.

- master copy: each parameter's value is written to its file in the model's dtype (or
  ``dtype``), copied off the device one parameter at a time (the store's entries refer to host
  stand-ins; the model's own parameters only ever hold device tensors, or host ones during
  their update);
- forward and backward: :mod:`._device_hooks` and :mod:`._device_copies` (file -> page-locked
  host buffer -> device, on a side stream, ``prefetch`` units ahead);
- gradients: :mod:`._device_grads` (device -> page-locked host buffer on a side stream, then
  written or accumulated as on the CPU path);
- update: :class:`~deepnvme.NVMeOptimizer` updates the host values through the offload, as for a
  CPU model (the parameter holds the host value during its update); the next use copies the
  new value to the device.

Device memory: ``max_device_bytes`` of parameter copies (default ``(prefetch + 2) x`` the
largest unit: the running module's, ``prefetch`` ahead, one for a parent module's or one that
autograd still holds) + the resident small parameters + the gradients in flight back (at most
twice the largest unit's bytes and a quarter of ``max_in_memory_bytes``, or one gradient) + one
placeholder element per dtype.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import IOConfig
from ..errors import OffloadMemoryError
from ..optim._protocol import mark_offloaded
from . import parameters
from ._autograd import SavedParameters
from ._build import build
from ._device import ComputeDevice, CudaDevice
from ._device_copies import DeviceCopies
from ._device_grads import DeviceGradients
from ._device_hooks import DeviceResidence
from ._entry import Buffer, Entry, _use_count, placeholder
from ._hooks import ModuleHooks
from ._order import OrderTracker
from ._store import TensorStore
from ._units import Units

__all__ = ["DeviceOffloadStats", "DeviceParameterOffload", "model_device", "offload_parameters"]


@dataclass(frozen=True)
class DeviceOffloadStats:
    """Device memory and copies of an offload training on a device, since it began (or since
    :meth:`DeviceParameterOffload.reset_stats`)."""

    device: str
    budget_bytes: int            # max_device_bytes
    held_bytes: int              # parameter buffers now (present, in flight, free for reuse)
    peak_bytes: int
    resident_bytes: int          # small parameters kept on the device for good
    bytes_to_device: int         # parameter copies host -> device
    bytes_to_host: int           # gradient copies device -> host
    prefetch_hits: int           # copies a prefetch had started before a module needed them


class _HostBuffer(Buffer):
    """A store buffer the device copies from and to asynchronously (page-locked with CUDA)."""

    __slots__ = ()

    def __init__(self, raw: torch.Tensor) -> None:   # Buffer's fields, other memory
        self.raw = raw
        self.alone = _use_count(raw)


class DeviceParameterOffload(parameters.ParameterOffload):
    """A :class:`~deepnvme.ParameterOffload` of a model that trains on ``device`` (see the module
    doc); :func:`offload_parameters` builds one for a CUDA model. ``device`` is the
    :class:`~._device.ComputeDevice` to train on (tests pass a CPU stand-in)."""

    fused_gradients = False   # gradients come back from the device apart from the consumer

    def __init__(self, model: torch.nn.Module, directory: str | os.PathLike[str], *,
                 device: ComputeDevice, max_in_memory_bytes: int, prefetch: int = 2,
                 dtype: torch.dtype | None = None, config: IOConfig | None = None,
                 min_offload_bytes: int | None = None, offload_gradients: bool = True,
                 max_device_bytes: int | None = None) -> None:
        # ParameterOffload.__init__ is not called: it installs the CPU path's hooks
        if max_in_memory_bytes < 1:
            raise OffloadMemoryError(f"max_in_memory_bytes must be >= 1, got {max_in_memory_bytes}")
        if min_offload_bytes is not None and min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be >= 0, got {min_offload_bytes}")
        if max_device_bytes is not None and max_device_bytes < 1:
            raise OffloadMemoryError(f"max_device_bytes must be >= 1, got {max_device_bytes}")
        forward, backward = OrderTracker(prefetch), OrderTracker(prefetch)  # checks prefetch
        self.model = model
        self.offload_gradients = bool(offload_gradients)
        self.device = device
        self._store = TensorStore(directory, budget=max_in_memory_bytes, config=config)
        self._store.new_buffer = lambda nbytes: _HostBuffer(device.host_empty(nbytes))
        self._entries: dict[int, tuple[Entry, Entry]] = {}
        self._dtensors: dict[int, tuple[Entry, Entry]] = {}   # FSDP2 shards: not on a device path
        self._grad_hooks = []
        self._copies = DeviceCopies(self._store, device, {})
        self._grads = DeviceGradients(self._store, device, cap=1, relieve=self._copies.settle)
        units = Units()
        residence = DeviceResidence(self._copies, self._grads)
        hooks = ModuleHooks(model, residence, units, SavedParameters(residence, units, backward), forward)
        self._modules = hooks
        try:
            largest, largest_name = 0, ""
            for module, name, unit in self._build(dtype, config, min_offload_bytes):
                nbytes = sum(e.nbytes for e in unit if not e.resident)
                if nbytes > largest:
                    largest, largest_name = nbytes, name or type(module).__name__
                hooks.add(module, name, unit)
            self._copies.budget = (max_device_bytes if max_device_bytes is not None
                                   else max(1, (prefetch + 2) * largest))
            self._grads.cap = max(1, min(2 * largest, max_in_memory_bytes // 4))
            if largest > self._copies.budget:
                raise OffloadMemoryError(
                    f"module {largest_name!r} has {largest} bytes of parameters to copy to the "
                    f"device, more than max_device_bytes={self._copies.budget}; raise it")
            self._activate()
            hooks.install_root()
        except BaseException:
            self.close()
            raise

    def _build(self, dtype: torch.dtype | None, config: IOConfig | None,
               min_offload_bytes: int | None) -> list[tuple[torch.nn.Module, str, list[Entry]]]:
        """Write every parameter to its file one at a time, copied off the device (see the
        module doc); the model keeps its own parameters, with their values (a failure leaves
        it as it was); the units."""
        model = self.model
        originals = _to_meta(model)
        min_offload = (parameters.MIN_OFFLOAD_BYTES if min_offload_bytes is None
                       else min_offload_bytes)

        def value(name: str, out: torch.Tensor) -> None:
            out.copy_(originals[name].detach())

        try:
            built = build(model, self._store, dtype=dtype, source=value, config=config,
                          min_offload=min_offload,
                          offload_gradients=self.offload_gradients)
        finally:
            fresh = _restore(model, originals)     # id(built parameter) -> the model's own
        for pid, (d, g) in built.entries.items():
            p = fresh[pid]
            host = torch.nn.Parameter(placeholder(d.shape, d.dtype), requires_grad=False)
            d.param = g.param = host   # the store sets and clears this one's .data
            self._entries[id(p)] = (d, g)
            self._copies.params[d.key] = p
        return built.units

    def _activate(self) -> None:
        """Hand the parameters over: device placeholders (resident ones: device copies) in
        place of their values, marked as offloaded, their gradients taken as they come."""
        for d, _ in self._entries.values():
            p = self._copies.params[d.key]
            mark_offloaded(p, self)
            if d.resident:
                self._copies.make_resident(d)
            else:
                p.data = self.device.placeholder(d.shape, d.dtype)
            if p.requires_grad:
                self._grad_hooks.append(p.register_post_accumulate_grad_hook(self._on_grad))

    def _on_grad(self, p: torch.Tensor) -> None:
        grad, p.grad = p.grad, None
        if grad is not None:
            self._grads.take(self._entries[id(p)][1], grad)

    # --- the optimizer's side: updates run on the host values ---------------------------

    def zero_grad(self) -> None:
        self._grads.drain()
        super().zero_grad()

    def begin_update(self, params: Iterable[torch.Tensor]) -> None:
        params = list(params)
        triples = list(self._pairs(params))
        with self._store.lock:
            self._grads.drain()
            self._copies.settle()
            self._copies.forget(d for _, d, _ in triples)
        for p, d, _ in triples:        # a host tensor, so the host gradient can be set
            p.data = placeholder(d.shape, d.dtype)
        try:
            super().begin_update(params)
        except BaseException:
            self._back_to_device(triples)
            raise
        for p, d, _ in triples:
            p.data = d.tensor          # type: ignore[assignment]

    def end_update(self, params: Iterable[torch.Tensor]) -> None:
        params = list(params)
        try:
            super().end_update(params)
        finally:
            self._back_to_device(list(self._pairs(params)))

    def abort_update(self, params: Iterable[torch.Tensor]) -> None:
        params = list(params)
        try:
            super().abort_update(params)
        finally:
            self._back_to_device(list(self._pairs(params)))

    def _back_to_device(self, triples: list[tuple[torch.Tensor, Entry, Entry]]) -> None:
        for p, d, _ in triples:
            if d.resident:
                self._copies.refresh(d)
                p.data = self._copies.tensor(d)
            else:
                p.data = self.device.placeholder(d.shape, d.dtype)

    # --- the user's side -----------------------------------------------------------------

    def gradient(self, name: str) -> torch.Tensor | None:
        """A host copy of the accumulated gradient of ``name``, or None."""
        self._grads.drain()
        return super().gradient(name)

    def device_stats(self) -> DeviceOffloadStats:
        c = self._copies
        return DeviceOffloadStats(device=str(self.device.device), budget_bytes=c.budget,
                                  held_bytes=c.held, peak_bytes=c.peak,
                                  resident_bytes=c.resident_bytes, bytes_to_device=c.bytes_copied,
                                  bytes_to_host=self._grads.bytes_copied,
                                  prefetch_hits=c.prefetch_hits)

    def reset_stats(self) -> None:
        super().reset_stats()
        c = self._copies
        c.peak, c.bytes_copied, c.prefetch_hits, self._grads.bytes_copied = c.held, 0, 0, 0

    def close(self) -> None:
        """As :meth:`ParameterOffload.close`; waits for the copies in flight first."""
        self._grads.abandon()
        self._copies.close()
        super().close()


def _to_meta(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Put a meta parameter in place of each of ``model``'s (tied ones stay tied), so the
    offload's build asks for each value in turn; the originals by every name they have."""
    metas: dict[int, torch.nn.Parameter] = {}          # id(original) -> its meta stand-in
    original_of: dict[int, torch.nn.Parameter] = {}    # id(meta) -> the original
    originals: dict[str, torch.nn.Parameter] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for key, p in list(module._parameters.items()):
            if p is None:
                continue
            original = original_of.get(id(p), p)      # a module seen before under another name
            originals[f"{mname}.{key}" if mname else key] = original
            meta = metas.get(id(original))
            if meta is None:
                meta = metas[id(original)] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=p.dtype, device="meta"),
                    requires_grad=p.requires_grad)
                original_of[id(meta)] = original
            module._parameters[key] = meta
    return originals


def _restore(model: torch.nn.Module,
             originals: dict[str, torch.nn.Parameter]) -> dict[int, torch.nn.Parameter]:
    """Put the original parameters back in place of the built ones; built id -> original."""
    fresh: dict[int, torch.nn.Parameter] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for key, p in list(module._parameters.items()):
            if p is None:
                continue
            original = originals[f"{mname}.{key}" if mname else key]
            fresh[id(p)] = original
            module._parameters[key] = original
    return fresh


def model_device(model: torch.nn.Module) -> torch.device | None:
    """The accelerator ``model``'s parameters are on, or None for a CPU or meta model; a model
    spread over several devices, or on one that is not CUDA, is refused naming a parameter."""
    found: dict[torch.device, str] = {}
    for name, p in model.named_parameters():
        found.setdefault(p.device, name)
    accel = {d: n for d, n in found.items() if d.type not in ("cpu", "meta")}
    if not accel:
        return None
    if len(found) > 1:
        where = ", ".join(f"{n} on {d}" for d, n in found.items())
        raise ValueError(f"offload_parameters needs every parameter on one device; {where}: "
                         "move the model to one first")
    device, name = next(iter(accel.items()))
    if device.type != "cuda":
        raise ValueError(f"offload_parameters trains on the CPU or a CUDA device; {name} is on "
                         f"{device}")
    return device


def offload_parameters(model: torch.nn.Module, directory: str | os.PathLike[str], *,
                       max_device_bytes: int | None = None,
                       **options: Any) -> parameters.ParameterOffload:
    """Move ``model``'s parameters (and, in training, their gradients) to files under
    ``directory``: :func:`deepnvme.offload.parameters.offload_parameters` documents the options.

    A model whose parameters are on a CUDA device trains there (a
    :class:`DeviceParameterOffload`): each module's parameters are read from their files into
    page-locked memory and copied to the device on a side stream ahead of use, gradients come
    back the same way, and :class:`~deepnvme.NVMeOptimizer` updates the master copy on the CPU.
    ``max_device_bytes`` bounds the device memory of parameter copies (default ``(prefetch +
    2) x`` the largest module's parameters); ``source`` is for CPU or meta models.
    """
    device = model_device(model)
    if device is None:
        if max_device_bytes is not None:
            raise ValueError("max_device_bytes is for a model on a CUDA device; this one's "
                             "parameters are on the CPU")
        return parameters.offload_parameters(model, directory, **options)
    if options.get("source") is not None:
        raise ValueError("source= is for a model built on the meta device; this one's "
                         f"parameters are on {device}")
    options.pop("source", None)
    sharded = [name for name, p in model.named_parameters()
               if type(p).__name__ == "DTensor" or type(p.data).__name__ == "DTensor"]
    if sharded:
        raise ValueError(f"offload_parameters: {sharded[0]} is a DTensor on {device}: sharded "
                         "(FSDP2) models are offloaded from CPU meshes only; the device path "
                         "takes plain parameters")
    return DeviceParameterOffload(model, directory, device=CudaDevice(device),
                                  max_device_bytes=max_device_bytes, **options)
