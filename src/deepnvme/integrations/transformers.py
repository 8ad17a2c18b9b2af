"""Hugging Face transformers: ``from_pretrained`` and ``save_pretrained`` through deepnvme.

:func:`from_pretrained` builds the model with its parameters on the meta device (buffers real,
as ``__init__`` computes them), gives each parameter empty memory of its final dtype (tied
parameters stay one tensor) and fills them in place with :func:`deepnvme.load_into` from the
folder's safetensors shards: no second copy of the weights, parallel O_DIRECT reads, dtype
conversion through bounce buffers. :func:`save_pretrained` is ``model.save_pretrained`` with its
shard writes done by :func:`deepnvme.save_safetensors`, so the folder is what transformers
writes (config, shards, index, tied weights stored once). :class:`Trainer` (imported on first
use) saves and resumes its checkpoints the same way.

This module imports transformers (and accelerate, for the empty model); ``import deepnvme`` does not.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..checkpoint._fill_plan import TargetSpec, mismatch_error, plan_fill
from ..checkpoint._fresh import read_fresh
from ..checkpoint._load_path import load_paths
from ..checkpoint.inplace import load_into
from ..config import IOConfig, checkpoint_config
from ..formats.index import tensor_index
from ..formats.safetensors import StoredTensor
from ._hf_save import writes_through_deepnvme

try:
    import transformers
except ImportError as exc:  # pragma: no cover - the integration is imported by its users only
    raise ImportError("deepnvme.integrations.transformers needs transformers and accelerate: "
                      "pip install 'deepnvme[inference]'") from exc

if TYPE_CHECKING:
    from ._hf_trainer import Trainer

__all__ = ["Trainer", "from_pretrained", "save_pretrained", "writes_through_deepnvme"]

log = logging.getLogger(__name__)


def _model_class(model_class_or_name: Any) -> Any:
    """A transformers model class, given as a class or by its name in ``transformers``."""
    if isinstance(model_class_or_name, str):
        cls = getattr(transformers, model_class_or_name, None)
        if cls is None:
            raise ValueError(f"from_pretrained: transformers has no class named {model_class_or_name!r} "
                             "(pass a class such as AutoModelForCausalLM, or its name)")
        return cls
    if not isinstance(model_class_or_name, type) or not _builder(model_class_or_name):
        raise TypeError(f"from_pretrained: {model_class_or_name!r} is not a transformers model class "
                        "(an auto class or a PreTrainedModel subclass, e.g. AutoModelForCausalLM or LlamaForCausalLM)")
    return model_class_or_name


def _builder(cls: type) -> Callable[..., Any] | None:
    """How ``cls`` builds a model from a config: ``from_config`` (auto classes) or
    ``_from_config`` (model classes, transformers' own way for them)."""
    for name in ("from_config", "_from_config"):
        fn = getattr(cls, name, None)
        if callable(fn):
            return fn  # type: ignore[no-any-return]
    return None


def _resolve_dtype(dtype: Any, config: Any, floats: list[torch.dtype]) -> torch.dtype:
    """transformers' reading of ``dtype``: None or ``"auto"`` take the config's ``dtype``, else the
    checkpoint's first floating dtype; a name such as ``"bfloat16"`` is that torch dtype."""
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None)
        if dtype is None:
            return floats[0] if floats else torch.get_default_dtype()
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"from_pretrained: dtype must be a torch.dtype, its name, 'auto' or None, got {dtype!r}")
    return dtype


def _empty_model(cls: Any, config: Any, dtype: torch.dtype) -> nn.Module:
    """``cls`` built from ``config`` with parameters on the meta device and real buffers."""
    from accelerate import init_empty_weights

    with contextlib.ExitStack() as stack:
        stack.enter_context(init_empty_weights(include_buffers=False))
        try:
            no_init = importlib.import_module("transformers.initialization").no_init_weights
        except (ImportError, AttributeError):
            no_init = None
        if no_init is not None:  # random init of meta tensors is wasted work (seconds for a large model)
            stack.enter_context(no_init())
        model: nn.Module = _builder(cls)(config, dtype=dtype)  # type: ignore[misc]
    return model


def _fresh_parameters(model: nn.Module, rename: Mapping[str, str], sources: Mapping[str, StoredTensor],
                      cfg: IOConfig) -> dict[int, torch.Tensor]:
    """Read every meta parameter that the checkpoint stores as it is (same dtype and shape,
    row-major) into new memory by the device's fresh-load path: one region per shard, no
    bounce buffers, no copy. Keyed by ``id`` of the parameter (tied ones are read once)."""
    wanted: dict[int, tuple[str, StoredTensor]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        src = sources.get(rename.get(name, name))
        if param.device.type != "meta" or id(param) in wanted or src is None:
            continue
        if src.dtype == param.dtype and src.shape == tuple(param.shape) and src.stride is None:
            wanted[id(param)] = (name, src)
    if not wanted:
        return {}
    how = load_paths(next(iter(wanted.values()))[1].file, cfg).fresh
    got = read_fresh(dict(wanted.values()), how, cfg)
    log.debug("from_pretrained: %d parameters read %s", len(got), how)
    return {key: got[name] for key, (name, _) in wanted.items()}


def _check_shapes(model: nn.Module, rename: Mapping[str, str], sources: Mapping[str, StoredTensor]) -> None:
    """Every shape mismatch and unconvertible dtype at once, before any byte is read."""
    specs = {rename[n]: TargetSpec(t.dtype, tuple(t.shape), True, "cpu")
             for n, t in model.state_dict().items()}
    error = mismatch_error(plan_fill(specs, sources), strict=False)
    if error is not None:
        raise error


def _materialise(model: nn.Module, fresh: Mapping[int, torch.Tensor]) -> None:
    """Give every meta parameter its memory: read in ``fresh`` (by ``id``), else uninitialised
    CPU memory of its dtype; a parameter shared by several modules (tied weights) gets one
    tensor, so the tie holds."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            new = made.get(id(param))
            if new is None:
                data = fresh.get(id(param))
                new = nn.Parameter(torch.empty_like(param, device="cpu") if data is None else data,
                                   requires_grad=param.requires_grad)
                made[id(param)] = new
            module._parameters[name] = new


def _file_names(model: nn.Module, names: list[str], stored: set[str]) -> dict[str, str]:
    """Each state-dict name's name in the checkpoint: itself, or with the base model's prefix
    added or removed (a head model's checkpoint loaded into its base model, and back)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    if not prefix or any(n in stored for n in names):
        return {n: n for n in names}
    add = sum(f"{prefix}.{n}" in stored for n in names)
    drop = sum(n.startswith(prefix + ".") and n[len(prefix) + 1:] in stored for n in names)
    if add >= drop and add:
        return {n: f"{prefix}.{n}" for n in names}
    if drop:
        return {n: n[len(prefix) + 1:] if n.startswith(prefix + ".") else n for n in names}
    return {n: n for n in names}


def _missing(target: Mapping[str, torch.Tensor], stored: set[str]) -> set[str]:
    """The names ``target`` has and the checkpoint lacks, except tied names whose memory is
    filled under another name (what :func:`deepnvme.load_into` reports as missing)."""
    def alias(t: torch.Tensor) -> tuple[Any, ...]:
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())

    filled = {alias(t) for k, t in target.items() if k in stored and t.numel()}
    return {k for k, t in target.items() if k not in stored and not (t.numel() and alias(t) in filled)}


def _init_missing(model: nn.Module, missing: list[str]) -> None:
    """Initialise the modules owning ``missing`` tensors with the model's own ``_init_weights``
    (before the load: the tensors that are in the checkpoint are overwritten right after)."""
    init = getattr(model, "_init_weights", None)
    owners = {name.rpartition(".")[0] for name in missing}
    for mod_name, module in model.named_modules():
        if mod_name in owners:
            if callable(init):
                init(module)
            else:
                for p in module.parameters(recurse=False):
                    nn.init.zeros_(p)


def from_pretrained(model_class_or_name: Any, path: str | os.PathLike[str], *, dtype: Any = None,
                    **kwargs: Any) -> Any:
    """Load the transformers model saved in the local folder ``path``, like
    ``model_class.from_pretrained(path, dtype=dtype)``, reading the weights with deepnvme.

    ``model_class_or_name``: a model class (``AutoModelForCausalLM``, ``LlamaForCausalLM``, ...)
    or its name in ``transformers``. ``dtype``: as transformers reads it (None and ``"auto"``:
    the config's, else the checkpoint's). Keywords: ``config`` (a config object instead of
    ``path``'s ``config.json``), ``output_loading_info`` (also return the missing and unexpected
    names), ``io_config`` (deepnvme I/O settings); any other keyword overrides a config
    attribute, as in transformers. Missing weights are initialised by the model's
    ``_init_weights`` and logged, unexpected ones logged; a shape mismatch raises
    :class:`~deepnvme.CheckpointMismatchError` before any byte is read. Returns the model in
    eval mode on the CPU. Blocks. Memory: the model, plus :func:`deepnvme.load_into`'s bounce
    buffers when ``dtype`` differs from the checkpoint's.
    """
    cls = _model_class(model_class_or_name)
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"from_pretrained: {folder!r} is not a folder (a local save_pretrained folder)")
    io_config: IOConfig | Mapping[str, Any] | None = kwargs.pop("io_config", None)
    output_loading_info = bool(kwargs.pop("output_loading_info", False))
    config = kwargs.pop("config", None)
    if config is None:
        config, kwargs = transformers.AutoConfig.from_pretrained(folder, return_unused_kwargs=True, **kwargs)
    else:
        for key in [k for k in kwargs if hasattr(config, k)]:
            setattr(config, key, kwargs.pop(key))
    if kwargs:
        raise TypeError(f"from_pretrained: unsupported keyword(s) {sorted(kwargs)} (not config attributes)")
    index = tensor_index(folder)
    stored = set(index.tensors)
    dtype = _resolve_dtype(dtype, config, [t.dtype for t in index.tensors.values() if t.dtype.is_floating_point])
    config.dtype = dtype
    model = _empty_model(cls, config, dtype)
    names = list(model.state_dict())
    rename = _file_names(model, names, stored)
    _check_shapes(model, rename, index.tensors)
    cfg = checkpoint_config(io_config)
    fresh = _fresh_parameters(model, rename, index.tensors, cfg)
    _materialise(model, fresh)
    tie = getattr(model, "tie_weights", None)
    if callable(tie):
        tie()  # ties made in __init__ under the meta device are made again
    target = {rename[n]: t for n, t in model.state_dict().items()}
    missing = _missing(target, stored)
    _init_missing(model, [n for n in names if rename[n] in missing])
    read = {t.data_ptr() for t in fresh.values() if t.numel()}
    reinit = {n.rpartition(".")[0] for n in names if rename[n] in missing}  # _init_missing's modules
    rest = {rename[n]: t for n, t in model.state_dict().items()
            if not (t.numel() and t.data_ptr() in read) or n.rpartition(".")[0] in reinit}
    if rest:
        load_into(rest, folder, strict=False, config=cfg)
    missing_keys = [n for n in target if n in missing]
    unexpected_keys = [n for n in index.tensors if n not in target]
    if missing_keys:
        log.warning("from_pretrained: %s: weights not in the checkpoint, newly initialised: %s",
                    folder, missing_keys)
    if unexpected_keys:
        log.warning("from_pretrained: %s: checkpoint weights the model does not use: %s",
                    folder, unexpected_keys)
    _load_generation_config(model, folder)
    model.eval()
    if output_loading_info:
        return model, {"missing_keys": missing_keys, "unexpected_keys": unexpected_keys,
                       "mismatched_keys": [], "error_msgs": []}
    return model


def _load_generation_config(model: Any, folder: str) -> None:
    can_generate = getattr(model, "can_generate", None)
    if callable(can_generate) and can_generate() and os.path.isfile(os.path.join(folder, "generation_config.json")):
        model.generation_config = transformers.GenerationConfig.from_pretrained(folder)


def save_pretrained(model: Any, directory: str | os.PathLike[str], **kwargs: Any) -> None:
    """``model.save_pretrained(directory, **kwargs)`` with every safetensors shard written by
    deepnvme (parallel O_DIRECT, fsynced, atomic rename): the same files, names, index and
    ``max_shard_size`` rule; transformers and safetensors read them. ``io_config``: deepnvme I/O
    settings. Blocks until every shard is durable."""
    io_config = kwargs.pop("io_config", None)
    if not callable(getattr(model, "save_pretrained", None)):
        raise TypeError(f"save_pretrained: {type(model).__name__} is not a transformers model (no save_pretrained)")
    with writes_through_deepnvme(io_config):
        model.save_pretrained(directory, **kwargs)



def __getattr__(name: str) -> Any:
    """:class:`Trainer` on first use (importing ``transformers.Trainer`` takes seconds)."""
    if name == "Trainer":
        from ._hf_trainer import Trainer
        return Trainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
