"""``from_deepspeed_config``: ZeRO-Infinity's NVMe offload settings applied to a plain torch loop.

Reads ``zero_optimization.offload_param``, ``zero_optimization.offload_optimizer`` and the
``aio`` section of a DeepSpeed config (a dict, or a path to its JSON file). Keys that change
nothing here are named in one warning; values that cannot work raise :class:`ConfigError`
naming the key. Mapping: parameters go to :func:`offload_parameters` under ``offload_param
.nvme_path`` with a budget of ``buffer_count x buffer_size`` elements (DeepSpeed's pool for
swapped-in parameters); optimizer state goes to :class:`NVMeOptimizer` under
``offload_optimizer.nvme_path`` with its ``buffer_count``; ``aio`` becomes the :class:`IOConfig`.
``zero_optimization.stage3_param_persistence_threshold`` (elements; DeepSpeed keeps parameters
with fewer elements whole on every rank) becomes ``min_offload_bytes``: such parameters stay in
memory; without the key, deepnvme's own default applies. An ``nvme_path`` that is a list of
directories (one per drive) becomes a :class:`~deepnvme.Volume`: the files are striped over them.
``zero_optimization.sub_group_size`` (elements; DeepSpeed's unit of optimizer state swapped and
updated together) becomes :class:`NVMeOptimizer`'s ``sub_group_bytes`` (times the parameters'
element size): a larger parameter is updated in slices of that size, as DeepSpeed does; without
the key, deepnvme's own default applies.
``device: "cpu"`` or ``"none"`` keeps that part in memory (a CPU loop already has it there).
``zero_optimization.stage`` 3 under torch.distributed (an initialized process group of several
ranks): :meth:`DeepSpeedOffloadSettings.apply` shards the model with FSDP2 first, so each rank
offloads only its shards (see :func:`~deepnvme.offload._fsdp.shard_model`).
``aio.overlap_events`` (every engine overlaps anyway) and a true ``aio.use_gds`` (accepted where
a CUDA GPU exists; the offload's tensors are CPU tensors, which GDS does not move) are named in
the warning.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..config import IOConfig
from ..errors import ConfigError
from ..io.volume import Volume
from ..optim import NVMeOptimizer
from ._fsdp import shard_model
from .parameters import ParameterOffload, offload_parameters

__all__ = ["DeepSpeedOffloadSettings", "OptimizerOffloadSettings", "ParamOffloadSettings",
           "from_deepspeed_config"]

_DEVICES = ("none", "cpu", "nvme")
# keys that act in each offload section; the rest (max_in_cpu, pin_memory, pipeline_read ...)
# are named in the warning: deepnvme reads into ordinary memory under one byte budget
_PARAM_KEYS = ("device", "nvme_path", "buffer_count", "buffer_size")
_OPTIMIZER_KEYS = ("device", "nvme_path", "buffer_count")
_PERSISTENCE = "stage3_param_persistence_threshold"
_SUB_GROUP = "sub_group_size"


@dataclass(frozen=True)
class ParamOffloadSettings:
    """``zero_optimization.offload_param`` with ``device: "nvme"`` (sizes in elements)."""

    nvme_path: str | Volume
    buffer_count: int = 5
    buffer_size: int = 100_000_000
    max_in_cpu: int = 1_000_000_000
    pin_memory: bool = False
    persistence_threshold: int | None = None  # elements; None: deepnvme's min_offload_bytes default

    def min_offload_bytes(self, element_size: int) -> int | None:
        """Parameters below this many bytes stay in memory (None: deepnvme's default)."""
        return None if self.persistence_threshold is None else self.persistence_threshold * element_size

    def max_in_memory_bytes(self, element_size: int) -> int:
        """The parameter budget: ``buffer_count x buffer_size`` elements of ``element_size`` bytes."""
        return self.buffer_count * self.buffer_size * element_size


@dataclass(frozen=True)
class OptimizerOffloadSettings:
    """``zero_optimization.offload_optimizer`` with ``device: "nvme"``."""

    nvme_path: str | Volume
    buffer_count: int = 4
    pin_memory: bool = False
    sub_group_size: int | None = None   # elements; None: deepnvme's sub_group_bytes default

    def sub_group_bytes(self, element_size: int) -> int | None:
        """``sub_group_size`` elements of ``element_size`` bytes (None: deepnvme's default)."""
        return None if self.sub_group_size is None else self.sub_group_size * element_size


@dataclass(frozen=True)
class DeepSpeedOffloadSettings:
    """What a DeepSpeed config asks of NVMe offload; ``None`` parts stay in memory."""

    io: IOConfig
    param: ParamOffloadSettings | None
    optimizer: OptimizerOffloadSettings | None
    unused_keys: tuple[str, ...]   # dotted keys that change nothing here (named in the warning)
    stage: int | None = None       # zero_optimization.stage (3: shard under torch.distributed)

    def offload_model(self, model: torch.nn.Module, *, prefetch: int = 2) -> ParameterOffload | None:
        """Offload ``model``'s parameters as ``offload_param`` says (None if it keeps them)."""
        if self.param is None:
            return None
        first = next(model.parameters(), None)
        size = 4 if first is None else first.element_size()
        return offload_parameters(model, self.param.nvme_path, prefetch=prefetch, config=self.io,
                                  max_in_memory_bytes=self.param.max_in_memory_bytes(size),
                                  min_offload_bytes=self.param.min_offload_bytes(size))

    def make_optimizer(self, params: Iterable[Any],
                       optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
                       **optimizer_kwargs: Any) -> torch.optim.Optimizer:
        """``optimizer_cls`` over ``params``: an :class:`NVMeOptimizer` when ``offload_optimizer``
        is on NVMe or the parameters are offloaded (their update reads them from files)."""
        params = list(params)
        offloaded = any(getattr(p, "_deepnvme_offload", None) is not None for p in _tensors(params))
        if self.optimizer is None and not offloaded:
            return optimizer_cls(params, **optimizer_kwargs)
        if self.optimizer is None:
            raise ConfigError("zero_optimization.offload_optimizer: the parameters are offloaded "
                              "to NVMe, so the optimizer must be too (set its device to 'nvme')")
        first = next((p for p in _tensors(params)), None)
        sub_group = self.optimizer.sub_group_bytes(4 if first is None else first.element_size())
        extra: dict[str, Any] = {} if sub_group is None else {"sub_group_bytes": sub_group}
        return NVMeOptimizer(params, optimizer_cls, swap_dir=self.optimizer.nvme_path,
                             buffer_count=self.optimizer.buffer_count, config=self.io,
                             **extra, **optimizer_kwargs)

    def apply(self, model: torch.nn.Module,
              optimizer_cls: type[torch.optim.Optimizer] = torch.optim.AdamW,
              **optimizer_kwargs: Any) -> tuple[ParameterOffload | None, torch.optim.Optimizer]:
        """Offload ``model`` and build its optimizer: ``(offload or None, optimizer)``. With
        stage 3 under torch.distributed, ``model`` is first sharded with ``fully_shard``."""
        if self.stage == 3:
            shard_model(model)
        offload = self.offload_model(model)
        try:
            return offload, self.make_optimizer(model.parameters(), optimizer_cls, **optimizer_kwargs)
        except BaseException:
            if offload is not None:
                offload.close()
            raise


def _tensors(params: list[Any]) -> list[torch.Tensor]:
    """The tensors of ``params`` (tensors, or param group dicts holding them)."""
    out: list[torch.Tensor] = []
    for p in params:
        if isinstance(p, torch.Tensor):
            out.append(p)
        elif isinstance(p, Mapping):
            out.extend(t for t in p.get("params", ()) if isinstance(t, torch.Tensor))
    return out


def _load(config: Mapping[str, Any] | str | os.PathLike[str]) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    if not isinstance(config, (str, os.PathLike)):
        raise ConfigError(f"a DeepSpeed config is a dict or a JSON file path, got {type(config).__name__}")
    try:
        with open(config, encoding="utf-8") as f:
            loaded = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the DeepSpeed config {os.fspath(config)!r}: {exc}") from exc
    if not isinstance(loaded, Mapping):
        raise ConfigError(f"the DeepSpeed config {os.fspath(config)!r} is not a JSON object")
    return loaded


def _count(section: Mapping[str, Any], key: str, where: str, default: int, minimum: int) -> int:
    value = section.get(key, default)
    if isinstance(value, float) and value.is_integer():
        value = int(value)   # DeepSpeed configs write sizes such as 1e8
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}.{key} must be an integer >= {minimum}, got {value!r}")
    return value


def _flag(section: Mapping[str, Any], key: str, where: str) -> bool:
    value = section.get(key, False)
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{key} must be true or false, got {value!r}")
    return value


def _section(zero: Mapping[str, Any], name: str, used: tuple[str, ...],
             unused: list[str]) -> Mapping[str, Any] | None:
    """The offload section ``name`` if its device is "nvme" (checked), else None."""
    where = f"zero_optimization.{name}"
    section = zero.get(name)
    if section is None:
        return None
    if not isinstance(section, Mapping):
        raise ConfigError(f"{where} must be an object, got {type(section).__name__}")
    device = section.get("device", "none")
    if device not in _DEVICES:
        raise ConfigError(f"{where}.device must be one of {list(_DEVICES)}, got {device!r}")
    if device != "nvme":
        unused.extend(f"{where}.{k}" for k in section if k != "device")
        return None
    path = section.get("nvme_path")
    paths = path if isinstance(path, (list, tuple)) and path else [path]
    if not all(isinstance(p, (str, os.PathLike)) and os.fspath(p) for p in paths):
        raise ConfigError(f"{where}.nvme_path is required with device 'nvme' (the directory "
                          f"for the files, or a list of them, one per drive), got {path!r}")
    unused.extend(f"{where}.{k}" for k in section if k not in used)
    return section


def from_deepspeed_config(config: Mapping[str, Any] | str | os.PathLike[str]
                          ) -> DeepSpeedOffloadSettings:
    """Read a DeepSpeed config (dict or JSON path) into :class:`DeepSpeedOffloadSettings`.

    Raises :class:`ConfigError` naming the key for values that cannot work (a missing
    ``nvme_path``, a zero ``buffer_size`` or ``buffer_count``, an unknown device, unknown
    ``aio`` keys, ``aio.use_gds`` true without a CUDA GPU); warns once naming every key that
    has no effect here. Reads no files but ``config`` and creates none.
    """
    cfg = _load(config)
    unused = [k for k in cfg if k not in ("zero_optimization", "aio")]
    zero = cfg.get("zero_optimization", {})
    if not isinstance(zero, Mapping):
        raise ConfigError(f"zero_optimization must be an object, got {type(zero).__name__}")
    unused += [f"zero_optimization.{k}" for k in zero
               if k not in ("offload_param", "offload_optimizer", _PERSISTENCE, "stage", _SUB_GROUP)]
    stage = _count(zero, "stage", "zero_optimization", 0, 0) if "stage" in zero else None
    if stage is not None and stage > 3:
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    aio = cfg.get("aio", {})
    if not isinstance(aio, Mapping):
        raise ConfigError(f"aio must be an object, got {type(aio).__name__}")
    if aio.get("use_gds") is True and not torch.cuda.is_available():
        raise ConfigError("aio.use_gds is true but this machine has no CUDA GPU (GPUDirect "
                          "Storage moves data between NVMe and GPU memory); set it to false")
    io = IOConfig.from_deepspeed(aio)
    # accepted by IOConfig for DeepSpeed compatibility, but they change nothing here: every
    # engine overlaps submissions and completions; the offload moves CPU tensors, which GDS
    # (CUDA tensors only) does not
    unused += [f"aio.{k}" for k in ("overlap_events", "use_gds")
               if k in aio and (k != "use_gds" or aio[k] is True)]
    param = _param_settings(zero, unused)
    if param is None and _PERSISTENCE in zero:   # it acts on offloaded parameters only
        unused.append(f"zero_optimization.{_PERSISTENCE}")
    optimizer = _optimizer_settings(zero, unused)
    if optimizer is None and _SUB_GROUP in zero:   # it sizes the NVMe optimizer's sub-groups only
        unused.append(f"zero_optimization.{_SUB_GROUP}")
    if unused:
        warnings.warn(f"deepnvme ignores these DeepSpeed config keys (no effect on NVMe offload "
                      f"of a plain torch loop): {', '.join(unused)}", UserWarning, stacklevel=2)
    return DeepSpeedOffloadSettings(io=io, param=param, optimizer=optimizer, unused_keys=tuple(unused),
                                    stage=stage)


def _param_settings(zero: Mapping[str, Any], unused: list[str]) -> ParamOffloadSettings | None:
    where = "zero_optimization.offload_param"
    s = _section(zero, "offload_param", _PARAM_KEYS, unused)
    if s is None:
        return None
    return ParamOffloadSettings(
        nvme_path=_nvme_path(s["nvme_path"], where), buffer_count=_count(s, "buffer_count", where, 5, 1),
        buffer_size=_count(s, "buffer_size", where, 100_000_000, 1),
        max_in_cpu=_count(s, "max_in_cpu", where, 1_000_000_000, 0),
        pin_memory=_flag(s, "pin_memory", where),
        persistence_threshold=(_count(zero, _PERSISTENCE, "zero_optimization", 0, 0)
                               if _PERSISTENCE in zero else None))


def _optimizer_settings(zero: Mapping[str, Any], unused: list[str]) -> OptimizerOffloadSettings | None:
    where = "zero_optimization.offload_optimizer"
    s = _section(zero, "offload_optimizer", _OPTIMIZER_KEYS, unused)
    if s is None:
        return None
    return OptimizerOffloadSettings(nvme_path=_nvme_path(s["nvme_path"], where),
                                    buffer_count=_count(s, "buffer_count", where, 4, 2),
                                    pin_memory=_flag(s, "pin_memory", where),
                                    sub_group_size=(_count(zero, _SUB_GROUP, "zero_optimization", 1, 1)
                                                    if _SUB_GROUP in zero else None))


def _nvme_path(value: Any, where: str) -> str | Volume:
    """One directory, or a list of directories (one per drive) as a :class:`Volume`."""
    if not isinstance(value, (list, tuple)):
        return str(os.fspath(value))
    try:
        return Volume(value)
    except ConfigError as exc:
        raise ConfigError(f"{where}.nvme_path: {exc}") from None
