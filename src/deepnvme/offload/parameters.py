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

A model sharded with FSDP2 (``fully_shard``) is offloaded rank by rank: each rank's shards
(the DTensors' local tensors) go to its files, each FSDP group's shards are read back for its
all-gather (ahead, in the order FSDP issues them), reduce-scattered gradients are taken as they
arrive, and the optimizer updates the local shards (:mod:`._ranks`, :mod:`._fsdp`).

By job: :mod:`._build` turns the model into entries (materialising meta parameters from a
source), :mod:`._hooks` fetches them around modules, :mod:`._autograd` packs saved parameters,
:mod:`._gradients` takes gradients in, :mod:`._updates` serves the optimizer, and
:mod:`._store` holds it all under the budget.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from ..config import IOConfig
from ..errors import OffloadMemoryError
from ..io.volume import Volume
from ..optim._protocol import mark_offloaded, offload_of
from ._autograd import SavedParameters
from ._build import build
from ._entry import Entry
from ._fsdp import Shard, is_sharded_model
from ._gradients import accept_gradient
from ._hooks import ModuleHooks, StoreResidence
from ._order import OrderTracker
from ._ranks import ShardHooks, build_shards
from ._sources import Init
from ._store import TensorStore
from ._units import Units
from ._updates import UpdateSide

__all__ = ["OffloadStats", "ParameterOffload", "offload_parameters", "register_external_parameter"]

log = logging.getLogger(__name__)

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


class ParameterOffload(UpdateSide):
    """The offload of one model's parameters and gradients (see :func:`offload_parameters`).

    It marks each parameter it holds, so :class:`~deepnvme.NVMeOptimizer` finds it there and
    updates through it (it implements ``deepnvme.optim._protocol.OffloadedParameters``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        directory: str | os.PathLike[str] | Volume,
        *,
        max_in_memory_bytes: int,
        prefetch: int = 2,
        dtype: torch.dtype | None = None,
        config: IOConfig | None = None,
        source: str | os.PathLike[str] | Init | None = None,
        min_offload_bytes: int | None = None,
        offload_gradients: bool = True,
    ) -> None:
        if max_in_memory_bytes < 1:
            raise OffloadMemoryError(f"max_in_memory_bytes must be >= 1, got {max_in_memory_bytes}")
        if min_offload_bytes is not None and min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be >= 0, got {min_offload_bytes}")
        forward, backward = OrderTracker(prefetch), OrderTracker(prefetch)  # checks prefetch
        self.model = model
        self.offload_gradients = bool(offload_gradients)
        self._store = TensorStore(directory, budget=max_in_memory_bytes, config=config)
        self._entries: dict[int, tuple[Entry, Entry]] = {}  # id(param) -> (data, grad)
        self._dtensors: dict[int, tuple[Entry, Entry]] = {}  # FSDP2: id(DTensor param) -> pair
        units = Units()
        residence = StoreResidence(self._store)
        self._modules: ModuleHooks | ShardHooks = ModuleHooks(
            model, residence, units, SavedParameters(residence, units, backward), forward
        )
        self._grad_hooks: list[RemovableHandle] = []
        min_offload = MIN_OFFLOAD_BYTES if min_offload_bytes is None else min_offload_bytes
        if is_sharded_model(model):
            self._offload_shards(source, dtype, prefetch, min_offload)
            return
        try:
            built = build(
                model,
                self._store,
                dtype=dtype,
                source=source,
                config=config,
                min_offload=min_offload,
                offload_gradients=self.offload_gradients,
            )
            self._entries = built.entries
            for module, name, unit in built.units:
                self._modules.add(module, name, unit)
            for data, _ in self._entries.values():
                mark_offloaded(data.param, self)
                if data.param.requires_grad:
                    self._grad_hooks.append(data.param.register_post_accumulate_grad_hook(self._on_grad))
            self._modules.install_root()
        except BaseException:
            self.close()
            raise

    def _offload_shards(self, source: object, dtype: torch.dtype | None, prefetch: int, min_offload: int) -> None:
        """A ``fully_shard``-ed model: this rank's shards are offloaded (see :mod:`._ranks`)."""
        try:
            if source is not None or dtype is not None:
                raise ValueError(
                    "offload_parameters: source= and dtype= apply to a model before "
                    "fully_shard; materialise and convert it first, then shard it"
                )
            built = build_shards(
                self.model, self._store, min_offload=min_offload, offload_gradients=self.offload_gradients
            )
            self._entries, self._dtensors = built.entries, built.by_dtensor
            for data, _ in self._entries.values():
                mark_offloaded(data.param, self)
            for fp in (fp for group, _ in built.units for fp in group.params):
                mark_offloaded(fp.sharded_param, self)
            self._modules = ShardHooks(self.model, self._store, built, prefetch)
            self.trim_each_step = False   # the heap's free memory is FSDP's, back every step
        except BaseException:
            self.close()
            raise

    def local_parameter(self, param: torch.Tensor) -> torch.nn.Parameter | None:
        """The plain parameter holding this rank's shard of ``param`` (an FSDP2 DTensor
        parameter offloaded here), which :class:`~deepnvme.NVMeOptimizer` updates; None if
        ``param`` is not one."""
        pair = self._dtensors.get(id(param))
        return None if pair is None else pair[0].param

    def sharded_parameter(self, local: torch.Tensor) -> torch.nn.Parameter | None:
        """The FSDP2 DTensor parameter whose shard ``local`` (a :meth:`local_parameter`) holds,
        or None: FSDP2 runs its post-accumulate-grad hooks after the reduce-scatter."""
        pair = self._entries.get(id(local))
        home = None if pair is None else pair[0].home
        return home.dtensor if isinstance(home, Shard) else None

    def register_external_parameter(self, module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
        """Fetch ``parameter`` for ``module``'s forward too (and keep it for its backward).

        For a parameter that ``module``'s own forward uses although another module owns it, e.g.
        ``F.linear(h, self.embed.weight)`` in the root module: each module's hooks fetch only the
        parameters it owns, so outside them an offloaded parameter holds its placeholder (NaN).
        DeepSpeed's ``deepspeed.zero.register_external_parameter`` does the same for ZeRO-3.
        """
        if self._dtensors:
            raise ValueError(
                "register_external_parameter: not needed with FSDP2, whose "
                "all-gathers bring every parameter its modules use"
            )
        pair = self._entries.get(id(parameter))
        if pair is None:
            raise ValueError(
                "register_external_parameter: the parameter (shape "
                f"{list(parameter.shape)}) is not one of the offloaded model's"
            )
        name = next((n for n, m in self.model.named_modules() if m is module), None)
        if name is None:
            raise ValueError(
                f"register_external_parameter: the module {type(module).__name__} is not part of the offloaded model"
            )
        assert not isinstance(self._modules, ShardHooks)  # FSDP2 models refused above; invariant
        self._modules.add_external(module, name, pair[0])

    def _on_grad(self, p: torch.Tensor) -> None:
        grad, p.grad = p.grad, None
        if grad is not None:
            accept_gradient(self._store, self._entries[id(p)][1], grad)

    # --- the user's side ----------------------------------------------------------------

    def _named(self, name: str) -> tuple[Entry, Entry]:
        for d, g in self._entries.values():
            if d.name == name:
                return d, g
        raise KeyError(f"no offloaded parameter named {name!r}")

    def _copy(self, entry: Entry) -> torch.Tensor:
        self._store.fetch([entry], f"reading {entry.name}")
        try:
            assert entry.tensor is not None  # fetch made it present; internal invariant
            # an FSDP2 shard's stored tensor may be padded: its parameter is the shard itself
            return (entry.tensor if entry.home is None else entry.param.data).clone()
        finally:
            self._store.unpin([entry])

    def parameter(self, name: str) -> torch.Tensor:
        """A copy of the parameter ``name`` (its qualified name in the model); of a
        ``fully_shard``-ed model, this rank's shard of it (the DTensor's local tensor)."""
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
            sharded = self._dtensors.get(id(value))
            if sharded is not None:  # a DTensor of this rank's shard, as FSDP2's state dict
                out[name] = _as_dtensor(value, self._copy(sharded[0]))
            else:
                out[name] = self._copy(pair[0]) if pair is not None else value.detach()
        return out

    def stats(self) -> OffloadStats:
        s = self._store
        return OffloadStats(
            budget_bytes=s.budget,
            held_bytes=s.held,
            peak_bytes=s.peak,
            bytes_read=s.bytes_read,
            bytes_written=s.bytes_written,
            prefetch_hits=s.prefetch_hits,
            buffers_reused=s.reused,
        )

    def reset_stats(self) -> None:
        s = self._store
        s.peak, s.bytes_read, s.bytes_written, s.prefetch_hits, s.reused = s.held, 0, 0, 0, 0

    @property
    def directory(self) -> str:
        """The private directory holding the parameter and gradient files."""
        return self._store.swapper.directory

    def close(self) -> None:
        """Remove the hooks and delete the files (the parameters are lost unless read back),
        with ``directory`` if the offload created it and nothing else is in it. Idempotent."""
        self._modules.remove()
        for h in self._grad_hooks:
            h.remove()
        self._grad_hooks.clear()
        self._store.close()

    def __enter__(self) -> ParameterOffload:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _as_dtensor(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    assert isinstance(like, DTensor)  # an FSDP2 parameter; internal invariant
    return DTensor.from_local(
        local, like.device_mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def offload_parameters(
    model: torch.nn.Module,
    directory: str | os.PathLike[str] | Volume,
    *,
    max_in_memory_bytes: int,
    prefetch: int = 2,
    dtype: torch.dtype | None = None,
    config: IOConfig | None = None,
    source: str | os.PathLike[str] | Init | None = None,
    min_offload_bytes: int | None = None,
    offload_gradients: bool = True,
) -> ParameterOffload:
    """Move ``model``'s parameters (and, in training, their gradients) to files under ``directory``.

    Each submodule's own parameters are read in before its forward and again when the backward
    needs them, the next ``prefetch`` modules in execution order are read ahead (the order is
    learned on the first pass and re-learned when it changes), and gradients are written as
    autograd produces them, accumulated across backward passes until ``zero_grad``. Train with
    :class:`~deepnvme.NVMeOptimizer`, which reads and writes the offloaded tensors.

    Memory: ``max_in_memory_bytes`` (parameters and gradients, reads in flight, writes not yet
    finished and free buffers kept for reuse included) + the one gradient autograd just produced
    + the NVMeOptimizer's ``buffer_count x`` one sub-group's state. The I/O buffers are the
    tensors themselves (page-aligned: the engine needs no bounce buffers). Activations and the
    optimizer's temporaries are the training loop's own, as in memory.

    A model sharded with FSDP2 (``fully_shard`` applied, the root included) under
    torch.distributed: each rank offloads only its own shards into its ``directory`` (a
    node-local one; ranks of one node may share it, each gets its private subdirectory), reads
    each FSDP group's shards back just before that group's all-gather (the next ``prefetch``
    groups in FSDP's all-gather order ahead), and stores the reduce-scattered gradients. Build
    :class:`~deepnvme.NVMeOptimizer` over ``model.parameters()``: it updates each rank's local
    shards. ``model.state_dict()`` then holds placeholders: use :meth:`ParameterOffload.state_dict`
    (DTensors of this rank's shards). ``source`` and ``dtype`` are refused (apply them first).

    Args:
        model: a CPU model, or one built on the meta device (``with torch.device("meta"):``)
            with ``source`` giving the values, so it never exists whole in memory; or a model
            sharded with FSDP2 on CPU (gloo).
        directory: where a private subdirectory holds the files (created if missing; removed by
            :meth:`ParameterOffload.close`, with ``directory`` itself if the offload created it
            and nothing else is in it).
        max_in_memory_bytes: the budget of parameter and gradient bytes in memory. Each module's
            own parameters, and each optimizer sub-group's parameters plus gradients, must fit
            it: a parameter larger than the budget, or than half of it for its update, is
            refused when the offload or the optimizer is built, naming it.
        prefetch: how many modules ahead (in the learned order) to read in advance; 0 for none.
        dtype: convert the parameters to this dtype first (None keeps theirs).
        config: the I/O settings of the handle for the files (and for reading ``source``).
        source: the values of a meta-device model's parameters and buffers, one tensor at a
            time, each written to its file before the next: a safetensors checkpoint (a file,
            or a folder with ``model.safetensors`` or a sharded index; names as in
            ``model.state_dict()``), or a function ``init(name, tensor)`` filling an
            uninitialised tensor in place. None for a model with real parameters.
        min_offload_bytes: parameters smaller than this stay in memory with their gradients
            (default :data:`MIN_OFFLOAD_BYTES`: biases, norm weights), as DeepSpeed's
            ``stage3_param_persistence_threshold`` keeps small parameters, each of which would
            otherwise cost a file request per use for a few KiB. They count in the budget for
            good (3 x their size: value, gradient, a copy for a failed update), at most an
            eighth of it (further small ones are offloaded); 0 offloads every parameter.
        offload_gradients: False keeps every gradient in memory (one mapping of the
            parameters' size, outside ``max_in_memory_bytes``), as DeepSpeed's ZeRO-3 keeps
            its gradient partitions: each step then moves two fewer passes over the parameters'
            bytes (no gradient written after the backward and read back for the update).

    Returns:
        The :class:`ParameterOffload`; close it (or use it as a context manager) to delete the
        files.

    Raises:
        OffloadMemoryError: a module or parameter that cannot fit ``max_in_memory_bytes``, at
            build time or when a module needs more than is free while everything is pinned.
        ValueError: a parameter not on the CPU, or on the meta device without ``source``.
        CheckpointMismatchError: ``source`` lacks a tensor the model needs, or its shape differs.
    """
    return ParameterOffload(
        model,
        directory,
        max_in_memory_bytes=max_in_memory_bytes,
        prefetch=prefetch,
        dtype=dtype,
        config=config,
        source=source,
        min_offload_bytes=min_offload_bytes,
        offload_gradients=offload_gradients,
    )


def register_external_parameter(module: torch.nn.Module, parameter: torch.nn.Parameter) -> None:
    """Make ``module``'s forward fetch ``parameter``, an offloaded parameter that another module
    owns (see :meth:`ParameterOffload.register_external_parameter`); the name and use of
    DeepSpeed's ``deepspeed.zero.register_external_parameter``."""
    offload = offload_of(parameter)
    if not isinstance(offload, ParameterOffload):
        raise ValueError(
            "register_external_parameter: the parameter (shape "
            f"{list(parameter.shape)}) is not offloaded; call offload_parameters first"
        )
    offload.register_external_parameter(module, parameter)
