"""Hugging Face accelerate: ``Accelerator.save_state`` / ``load_state`` through deepnvme.

``install(accelerator)`` wraps that accelerator's ``save_state`` and ``load_state``: during each
call, the three functions accelerate's checkpointing module writes and reads with
(``accelerate.checkpointing.save``, ``load`` and ``load_model``) are deepnvme's. The folder
keeps accelerate's layout and formats: ``model.safetensors`` (or ``pytorch_model.bin``) written
by :func:`deepnvme.save_safetensors` (:func:`deepnvme.save`), ``optimizer.bin`` and
``scheduler.bin`` by :func:`deepnvme.save`; models are filled in place by
:func:`deepnvme.load_into`, the other files read by :func:`deepnvme.load` with accelerate's
``weights_only`` rules. The small files accelerate writes with ``torch.save`` itself (RNG
states, sampler, gradient scaler, custom objects) stay as they are. A plain ``Accelerator``
reads the folder, and an installed one reads a plain one's.

Swapping module functions is process-wide: one installed call runs at a time (a lock), and
calls of accelerators that are not installed, made meanwhile from other threads, would go
through deepnvme too.

This module imports accelerate; ``import deepnvme`` does not.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ..checkpoint.inplace import load_into
from ..checkpoint.loader import load
from ..checkpoint.safetensors import save_safetensors
from ..checkpoint.saver import save
from ..config import IOConfig

try:
    from accelerate import checkpointing
    from accelerate.state import PartialState
    from accelerate.utils import clean_state_dict_for_safetensors
except ImportError as exc:  # pragma: no cover - imported by its users only
    raise ImportError("deepnvme.integrations.accelerate needs accelerate: pip install accelerate") from exc

__all__ = ["install", "uninstall"]

log = logging.getLogger(__name__)

_lock = threading.RLock()
_INSTALLED = "_deepnvme_originals"


def _saver(config: IOConfig | Mapping[str, Any] | None) -> Callable[..., None]:
    def deepnvme_save(obj: Any, f: Any, save_on_each_node: bool = False, safe_serialization: bool = False) -> None:
        """accelerate's ``save`` (same processes write, same formats), written by deepnvme."""
        state = PartialState()
        if not (state.is_local_main_process if save_on_each_node else state.is_main_process):
            return
        if safe_serialization:
            if isinstance(obj, OrderedDict):
                obj = clean_state_dict_for_safetensors(obj)
            save_safetensors(obj, f, {"format": "pt"}, config=config)
        else:
            save(obj, f, config=config)
    return deepnvme_save


def _loader(config: IOConfig | Mapping[str, Any] | None) -> Callable[..., Any]:
    def deepnvme_load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
        """accelerate's ``load``: ``weights_only`` by default, numpy arrays allowed."""
        from accelerate.utils.other import TORCH_SAFE_GLOBALS

        weights_only = bool(kwargs.pop("weights_only", True))
        if kwargs:
            raise TypeError(f"deepnvme's accelerate load: unsupported keyword(s) {sorted(kwargs)} for {f!r}")
        with torch.serialization.safe_globals(TORCH_SAFE_GLOBALS):
            return load(f, map_location, weights_only=weights_only, config=config)
    return deepnvme_load


def _model_loader(config: IOConfig | Mapping[str, Any] | None) -> Callable[..., Any]:
    def deepnvme_load_model(model: torch.nn.Module, filename: str | os.PathLike[str], strict: bool = True,
                            device: Any = "cpu") -> tuple[list[str], list[str]]:
        """safetensors' ``load_model`` (the model's own device; tied names filled once)."""
        result = load_into(model, filename, strict=strict, config=config)
        return result.missing_keys, result.unexpected_keys
    return deepnvme_load_model


@contextlib.contextmanager
def _through_deepnvme(config: IOConfig | Mapping[str, Any] | None) -> Iterator[None]:
    swaps = {"save": _saver(config), "load": _loader(config), "load_model": _model_loader(config)}
    missing = [name for name in swaps if not callable(getattr(checkpointing, name, None))]
    if missing:
        raise RuntimeError(f"accelerate.checkpointing has no {missing}: this accelerate version's save_state "
                           "cannot be routed through deepnvme")
    with _lock:
        originals = {name: getattr(checkpointing, name) for name in swaps}
        for name, fn in swaps.items():
            setattr(checkpointing, name, fn)
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(checkpointing, name, fn)


def install(accelerator: Any, *, config: IOConfig | Mapping[str, Any] | None = None) -> Any:
    """Make ``accelerator.save_state`` and ``load_state`` write and read through deepnvme (module
    docstring: which files). ``config``: deepnvme I/O settings. Idempotent; returns
    ``accelerator``. Both calls block as before, until the files are durable / loaded."""
    if not callable(getattr(accelerator, "save_state", None)) or not callable(getattr(accelerator, "load_state", None)):
        raise TypeError(f"install: {type(accelerator).__name__} is not an accelerate.Accelerator "
                        "(no save_state/load_state)")
    if getattr(accelerator, _INSTALLED, None) is not None:
        return accelerator
    originals = {"save_state": accelerator.save_state, "load_state": accelerator.load_state}

    def wrap(method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def through(*args: Any, **kwargs: Any) -> Any:
            with _through_deepnvme(config):
                return method(*args, **kwargs)
        return through

    setattr(accelerator, _INSTALLED, originals)
    for name, method in originals.items():
        setattr(accelerator, name, wrap(method))
    return accelerator


def uninstall(accelerator: Any) -> None:
    """Undo :func:`install` on ``accelerator`` (no-op if not installed)."""
    originals = getattr(accelerator, _INSTALLED, None)
    if originals is None:
        return
    for name in originals:
        delattr(accelerator, name)  # the instance attribute hid the class's method
    delattr(accelerator, _INSTALLED)
