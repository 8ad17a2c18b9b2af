"""vLLM's ``load_format="deepnvme"`` and ``"deepnvme_stream"``: weights read with deepnvme's engine.

vLLM calls :func:`register` in each of its processes through the ``vllm.general_plugins`` entry
point, so ``LLM(model=DIR, load_format="deepnvme")`` and ``--load-format deepnvme`` work with no
import. ``model_loader_extra_config`` takes deepnvme I/O settings and ``read_window`` (see
:func:`deepnvme.integrations._weights.loader_options`). Memory: vLLM's model plus at most
``2 x max(read_window, largest tensor)`` bytes of read buffers (the stream's bound).
``deepnvme_stream`` serves a model larger than memory: its decoder layers' weights stream from
NVMe while the model runs (:mod:`deepnvme.integrations._layer_stream`). ``deepnvme_offload``,
its name before this release, stays registered (with a warning) so deployed configs keep
working. This module imports vLLM; nothing in ``deepnvme`` imports it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from torch import nn
from torch.nn import functional as F
from vllm import __version__ as vllm_version
from vllm.config import ModelConfig
from vllm.config.load import LoadConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from .._deprecation import module_aliases, warn_once
from ..errors import DeepNVMeError
from ..inference.install import streamer_of
from ..memory.heap import trim_heap
from ._layer_stream import StreamOptions, stream_layers, stream_options
from ._weights import LoaderOptions, checkpoint_tensors, loader_options, stream_weights

__all__ = ["LOAD_FORMAT", "STREAM_FORMAT", "DeepNVMeModelLoader", "DeepNVMeStreamLoader", "register"]

log = logging.getLogger(__name__)

LOAD_FORMAT = "deepnvme"
STREAM_FORMAT = "deepnvme_stream"
_OLD_STREAM_FORMAT = "deepnvme_offload"   # the name before this release; still registered


class DeepNVMeModelLoader(BaseModelLoader):  # type: ignore[misc]
    """Streams a local folder's safetensors checkpoint into ``model.load_weights``, then checks,
    as vLLM's default loader does, that every parameter of an unquantized model was loaded."""

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options: LoaderOptions = loader_options(load_config.model_loader_extra_config)

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing is downloaded: check the model is a local folder with a safetensors checkpoint."""
        checkpoint_tensors(model_config.model)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        load = _model_load_weights(model, LOAD_FORMAT)
        t0 = time.perf_counter()
        weights = stream_weights(model_config.model, self.options)
        try:
            loaded = load(weights)
        finally:
            weights.close()   # if load_weights stopped early: end the read in flight, free the handle
        log.info("deepnvme: loaded the weights of %s in %.2f s", model_config.model,
                 time.perf_counter() - t0)
        if model_config.quantization is None and loaded is not None:
            _check_all_loaded(model, loaded)


def _model_load_weights(model: nn.Module, load_format: str) -> Any:
    """``model.load_weights``, for a model whose weights all come from its checkpoint folder."""
    if getattr(model, "secondary_weights", ()):
        raise DeepNVMeError(f"load_format {load_format!r} reads one checkpoint folder; "
                            f"{type(model).__name__} also loads weights from other sources "
                            "(secondary_weights): use load_format 'safetensors'")
    load = getattr(model, "load_weights", None)
    if not callable(load):
        raise DeepNVMeError(f"{type(model).__name__} has no load_weights(weights) method, which "
                            f"load_format {load_format!r} feeds; it is not a vLLM model")
    return load


def _check_all_loaded(model: nn.Module, loaded: Any) -> None:
    """vLLM's own rule and message: every named parameter must come from the checkpoint."""
    tracker = DefaultModelLoader(LoadConfig(load_format="safetensors"))
    tracker.track_weights_loading(model, loaded, quantized=False)


class DeepNVMeStreamLoader(BaseModelLoader):  # type: ignore[misc]
    """Keeps the non-layer weights and the decoder layers ``memory_budget`` allows in memory and
    streams the other layers' weights from an aligned copy in ``packed_dir`` before each runs.

    vLLM's CPU backend repacks a Linear weight after loading (a oneDNN handle holding its own
    copy, or an sgl-kernel packed copy) and drops the parameter; a streamed weight is new at
    every step, so the Linear layers of streamed layers are marked to skip that dispatch and run
    ``torch.nn.functional.linear`` on the streamed (unpacked) weight. Unquantized models only.
    """

    load_format = STREAM_FORMAT   # the name that error messages give

    def __init__(self, load_config: LoadConfig) -> None:
        super().__init__(load_config)
        self.options: StreamOptions = stream_options(load_config.model_loader_extra_config,
                                                     load_format=self.load_format)
        self._streams = False

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing is downloaded: check the model is a local folder with a safetensors checkpoint."""
        checkpoint_tensors(model_config.model, load_format=self.load_format)

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        if model_config.quantization is not None:
            raise DeepNVMeError(f"load_format {self.load_format!r} streams unquantized weights; "
                                f"{model_config.model} is quantized ({model_config.quantization})")
        load = _model_load_weights(model, self.load_format)
        t0 = time.perf_counter()
        result = stream_layers(model, model_config.model, self.options, load=load, fingerprint={
            # "engine" names the serving framework here; the key stays so aligned copies made
            # before are still recognised (renaming it would rewrite every copy once)
            "engine": f"vllm {vllm_version}", "dtype": str(model_config.dtype),
            "rank": get_tensor_model_parallel_rank(),
            "world": get_tensor_model_parallel_world_size()})
        _check_all_loaded(model, set(result.loaded))
        self._streams = bool(result.streamed)
        for block in streamer_of(model).blocks if self._streams else ():
            for sub in block.module.modules():
                if getattr(sub, "quant_method", None) is not None:
                    # vLLM's CPU flag (set for MLA's kv_b_proj): plain F.linear on .weight
                    object.__setattr__(sub, "_cpu_skip_gemm_dispatch", True)
        log.info("deepnvme: %s: %d layers (%d bytes) streamed from %s, %d layers (%d bytes) in memory, "
                 "%d bytes of staging buffers%s; %.2f s", model_config.model, len(result.streamed),
                 result.streamed_bytes, self.options.packed_dir, len(result.resident),
                 result.resident_bytes, result.staging_bytes,
                 ", aligned copy written" if result.converted else "", time.perf_counter() - t0)

    def load_model(self, vllm_config: Any, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        """vLLM's load, then a check that its post-processing left every streamed parameter in
        place and unpacked (a kernel holding its own copy would ignore the streamed bytes)."""
        model: nn.Module = super().load_model(vllm_config, model_config, prefix=prefix)
        # What loading and vLLM's repacking of the resident weights freed stays in glibc's heap
        # (96 MiB measured with a 1 GB model) unless handed back: a budgeted process needs it.
        trim_heap()
        for block in streamer_of(model).blocks if self._streams else ():
            present = {id(p) for p in block.module.parameters()}
            lost = [tuple(p.shape) for p, _ in block.bindings if id(p) not in present]
            repacked = [type(m).__name__ for m in block.module.modules()
                        if getattr(m, "cpu_linear", F.linear) is not F.linear]
            if lost or repacked:
                raise DeepNVMeError(f"load_format {self.load_format!r}: vLLM's weight post-processing "
                                    f"replaced streamed parameters (shapes {lost[:3]}) or repacked "
                                    f"{repacked[:3]} of a streamed layer; this platform/kernel "
                                    "cannot run on streamed weights")
        return model


class _OldFormatStreamLoader(DeepNVMeStreamLoader):
    """``load_format="deepnvme_offload"``: :class:`DeepNVMeStreamLoader` under its old name,
    warning once per process (in vLLM's log too, where serving configs are read)."""

    load_format = _OLD_STREAM_FORMAT

    def __init__(self, load_config: LoadConfig) -> None:
        message = (f"load_format {_OLD_STREAM_FORMAT!r} is deprecated and will be removed in the "
                   f"next release; use {STREAM_FORMAT!r} (same behaviour, same extra config)")
        if warn_once(f"vllm load_format {_OLD_STREAM_FORMAT}", message, stacklevel=2):
            log.warning("deepnvme: %s", message)
        super().__init__(load_config)


def register(**_: Any) -> None:
    """The ``vllm.general_plugins`` entry point: make ``load_format="deepnvme"`` and
    ``"deepnvme_stream"`` (and its old name ``"deepnvme_offload"``) known to vLLM.
    Safe to call more than once (vLLM loads plugins once per process)."""
    register_model_loader(LOAD_FORMAT)(DeepNVMeModelLoader)
    register_model_loader(STREAM_FORMAT)(DeepNVMeStreamLoader)
    register_model_loader(_OLD_STREAM_FORMAT)(_OldFormatStreamLoader)


__getattr__ = module_aliases(__name__, {"OFFLOAD_FORMAT": "STREAM_FORMAT",
                                        "DeepNVMeOffloadLoader": "DeepNVMeStreamLoader"})
